# One command sets up, one runs the main job, one runs the tests. Everything lands in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_OUT ?= demo-store

.PHONY: setup test demo lint typecheck bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	# speculators lists torchvision/torchaudio but never imports them; PyPI's builds are CUDA builds
	# that break `import transformers` beside the CPU torch, so they go.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio || true
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest -q tests

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
