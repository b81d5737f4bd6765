# The two commands of a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CKPT := .cache/tiny-ming
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint protos docs bench clean deploy-tools

# torch first and pinned: the CPU build (2.13.0) lies on this machine's disk; any torch already
# importable (the GPU image's 2.11) is kept, so `pip install -e .` pulls no other build.
# One line per step (the install takes minutes on a fresh machine), pip's own output kept quiet.
$(STAMP): pyproject.toml
	@echo "make: [1/4] the virtual environment $(VENV)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "make: [2/4] pip"
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "make: [3/4] torch (kept when one is importable; else torch==2.13.0, the CPU build)"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	@echo "make: [4/4] omnistage and what pyproject.toml names (the dev extra too; a few minutes the first time)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)
	@echo "make: $(VENV) ready"

install: $(STAMP)

$(CKPT)/config.json: | $(STAMP)
	@echo "make: the tiny random-weight checkpoint $(CKPT)"
	$(BIN)/omnistage make-tiny-checkpoint $(CKPT)

demo: $(STAMP) $(CKPT)/config.json
	$(BIN)/python -m omnistage.common.demo --config deploy/local-tiny.yaml --out demo-output

# tests/deploy validates the deploy/ files with docker-compose (no engine needed) and promtool, and
# tests/e2e/test_prometheus_live.py runs prometheus: Debian's prometheus and docker-compose packages,
# unpacked (never installed: no service, nothing outside the project, no root) into the git-ignored
# .tools/ by deploy/test-tools.sh; tests/conftest.py puts .tools/bin first on PATH. Without them those
# tests fail, never skip.
TOOLS_STAMP := .tools/bin/docker-compose

$(TOOLS_STAMP):
	deploy/test-tools.sh || echo "make: prometheus / docker-compose not unpacked (tests/deploy will fail)" >&2

deploy-tools: $(TOOLS_STAMP)

test: $(STAMP) deploy-tools
	$(BIN)/python -m pytest -q -ra --durations=50

test-fast: $(STAMP) deploy-tools
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The generated code and the API reference (docs/api.md) both come from protos/omnistage/v1/*.proto;
# tests/test_protos_fresh.py and tests/test_protodoc.py fail when either is stale.
protos: $(STAMP)
	$(BIN)/omnistage protos
	$(BIN)/python -m omnistage.common.protodoc

docs: $(STAMP)
	$(BIN)/python -m omnistage.common.protodoc

bench: $(STAMP) $(CKPT)/config.json
	$(BIN)/python load_tests/transport_bench.py
	$(BIN)/python bench/thinker_cpu.py

clean:
	rm -rf $(VENV) .cache demo-output .tools
