# The two commands of the README. Both set up ./.venv first (see .ci/setup-venv).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: help run test setup lint

## This list.
help:
	@awk '/^## /{text=substr($$0, 4); next} /^[a-z]+:/{if (text != "") printf "make %-6s %s\n", substr($$1, 1, length($$1)-1), text; text=""}' Makefile

## Create ./.venv with vLLM 0.33.0 and the project (one to two minutes; every other target runs it first).
setup:
	@VENV=$(VENV) bash .ci/setup-venv

## Main job: the DBO + DSA scenario on the embedded default (CPU: simulated H200, 132 SMs; GPU + DeepGEMM: real kernels).
run: setup
	@$(VENV)/bin/dbo-runtime simulate

## Whole CPU test suite + lint + types + repository hygiene (what CI runs). The GPU twins (tests/gpu) are deselected: see README.
test: setup
	$(PY) -m pytest -q -m "not gpu and not e2e and not e2e_dp2"
	$(VENV)/bin/ruff check dbo_runtime tests graphs tools
	$(VENV)/bin/mypy dbo_runtime
	$(PY) tools/lint_repo.py

## ruff, mypy and repository hygiene only.
lint: setup
	$(VENV)/bin/ruff check dbo_runtime tests graphs tools
	$(VENV)/bin/mypy dbo_runtime
	$(PY) tools/lint_repo.py
