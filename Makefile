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

demo: setup
	$(BIN)/orbitctl demo

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
