# crab's entry points.  The two that matter (see README.md):
#   make demo   set the host up, then run the checkpoint/restore/fork demo
#   make test   set the host up, then run the whole test suite
# Every set-up step is idempotent; a second `make setup` reinstalls nothing.
# `make setup` prints how long each of its steps took (scripts/timed.sh).

SHELL       := /bin/bash
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.crab-installed
PROTOS      := $(shell find crabd/api -name '*.proto' 2>/dev/null)
PYTEST_ARGS ?=
INIT_BIN    := crabd/runtime/init/crab-init
# Harbor (crabd/integrations/harbor.py) needs Python >= 3.12; the main venv is 3.11 (the CPU torch
# wheel of the rl extra is 3.11-only), so Harbor's tests run in a venv of their own.
# This machine kind has it from pyenv (not on PATH while pyenv's global version is 3.11).
# Only `make test`/`make integration` (and `make harbor-venv`) build it: `make setup` and `make demo`
# do not need Harbor, and it took 136 s of a fresh machine's set-up (measured; README.md).
HARBOR_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null))
HARBOR_VENV   ?= .venv-harbor
HARBOR_STAMP  := $(HARBOR_VENV)/.crab-installed
HARBOR_TESTS  := tests/unit/test_harbor_env.py tests/integration/test_harbor.py

.PHONY: setup host venv install harbor-venv images criu-kdat proto demo test unit integration lint bench clean-venv

setup: host venv install images criu-kdat

TIMED := bash scripts/timed.sh

host:
	@$(TIMED) host bash scripts/setup-host.sh

# crabctl and crabd for every user of the host: a venv of the system's Python in /opt/crab/venv with
# crab installed non-editable, linked into /usr/local/bin; systemd/crabd.service runs the same crabd.
# The checkout's .venv (below) is the developers' (tests, linters); its interpreter may be pyenv's,
# under root's 0700 home, which no member of group crab may enter, and its crab is the checkout's.  The script rebuilds only when the
# package's files changed (a fingerprint of their content), so a second run takes well under a second.
install: venv
	@$(TIMED) install env BUILD_PYTHON=$(abspath $(PY)) bash scripts/install-crab.sh

venv: $(STAMP) $(INIT_BIN)

# crab's in-sandbox init: static, so it runs in any image (even busybox).
$(INIT_BIN): crabd/runtime/init/crab-init.c
	@gcc -static -O2 -Wall -Wextra -Werror -o $@ $<

# Re-install only when the packaging inputs change.  bcc comes from Debian's
# python3-bpfcc (pure Python over libbcc via ctypes); it is linked into the
# venv rather than adding all of dist-packages to sys.path, so no other Debian
# module can shadow a pinned dependency.
# --no-compile: pip would byte-compile every module of every package (torch, Ray, ...), most never
# imported; that was more than half of this step on a fresh machine (159-209 s with it, 78-100 s
# without, measured back to back).  Python compiles what is imported, once, on first use (~2 s).
$(STAMP): pyproject.toml setup.py $(PROTOS)
	@$(TIMED) venv sh -c "{ test -x $(PY) || $(PYTHON) -m venv $(VENV); } && \
	  $(PY) -m pip install -q --disable-pip-version-check --no-compile -e '.[dev,bench,rl,remote,cluster,minisweagent,skyrl,gem,rock,swerex]'"
	@site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  if [ -d /usr/lib/python3/dist-packages/bcc ]; then ln -sfn /usr/lib/python3/dist-packages/bcc "$$site/bcc"; fi
	@touch $(STAMP)
	@echo "[setup] venv ready: $(VENV)"

harbor-venv: $(HARBOR_STAMP)

$(HARBOR_STAMP): pyproject.toml setup.py $(PROTOS)
	@test -n "$(HARBOR_PYTHON)" || { echo "[setup] Harbor needs Python >= 3.12: none found (set HARBOR_PYTHON)"; exit 1; }
	@$(TIMED) harbor-venv sh -c "{ test -x $(HARBOR_VENV)/bin/python || $(HARBOR_PYTHON) -m venv $(HARBOR_VENV); } && \
	  $(HARBOR_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,remote,harbor]'"
	@site=$$($(HARBOR_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  if [ -d /usr/lib/python3/dist-packages/bcc ]; then ln -sfn /usr/lib/python3/dist-packages/bcc "$$site/bcc"; fi
	@touch $(HARBOR_STAMP)
	@echo "[setup] harbor venv ready: $(HARBOR_VENV)"

images: venv
	@$(TIMED) images $(VENV)/bin/crabctl env build

# CRIU's kernel-feature cache where /run is not a tmpfs (crabd/host/criu_kdat.py); crabd redoes it at start.
criu-kdat: venv
	@$(TIMED) criu-kdat $(PY) -m crabd.host.criu_kdat install

proto: venv
	@$(PY) setup.py -q build_proto

demo: setup
	@$(VENV)/bin/crabctl doctor
	@$(PY) -m crabd.demo


test: setup harbor-venv lint
	@$(VENV)/bin/pytest -rxs $(PYTEST_ARGS) $(addprefix --ignore=,$(HARBOR_TESTS)) tests
	@$(HARBOR_VENV)/bin/pytest -rxs $(PYTEST_ARGS) $(HARBOR_TESTS)

unit: venv
	@$(VENV)/bin/pytest -rxs $(PYTEST_ARGS) --ignore=tests/unit/test_harbor_env.py tests/unit

integration: setup harbor-venv
	@$(VENV)/bin/pytest -rxs $(PYTEST_ARGS) --ignore=tests/integration/test_harbor.py tests/integration
	@$(HARBOR_VENV)/bin/pytest -rxs $(PYTEST_ARGS) tests/integration/test_harbor.py

lint: venv
	@$(VENV)/bin/ruff check crabd tests agents bench
	@$(VENV)/bin/ruff format --check crabd tests agents bench
	@$(VENV)/bin/mypy
	@$(VENV)/bin/lint-imports --no-cache

clean-venv:
	rm -rf $(VENV)
