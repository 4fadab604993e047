# Two commands on a fresh machine:
#   make demo   set everything up, then run the main job on the built-in tiny default
#   make test   set everything up, then run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test clean

setup: $(STAMP)

# torch is pinned to the CPU build that this machine keeps on disk; everything else comes from pyproject.toml
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# the main job: the memory plan of the shipped trillion-parameter profile, then the CPU training demo
# (build the tiny model, quantize it to NF4 with the streaming converter, LoRA + GRPO, accuracy before/after),
# then verify that the trained policy's train path and infer path agree
demo: setup
	$(BIN)/orbitctl plan profiles/kimi-k2_grpo_int4_8xb200.yaml
	$(BIN)/orbitctl train profiles/tiny-cpu.yaml
	$(BIN)/orbitctl verify-alignment profiles/tiny-cpu.yaml --per-layer

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
