# The two commands of the README. `make setup` builds both venvs first (see .ci/setup-venv):
# .venv with vLLM 0.34.0 (the current release) and .venv-0.33 with vLLM 0.33.0.
VENV ?= .venv
VENV33 ?= .venv-0.33
PY := $(VENV)/bin/python
PY33 := $(VENV33)/bin/python
PYTEST := -m pytest -q -p no:cacheprovider -m "not gpu and not e2e and not e2e_dp2"
LINT := $(VENV)/bin/ruff check dbo_runtime tests graphs tools && $(VENV)/bin/mypy dbo_runtime && $(PY) tools/lint_repo.py \
	&& $(PY) tools/size_report.py && $(PY) tools/prose_ratio.py --top 3

.PHONY: help run test setup lint

## This list.
help:
	@awk '/^## /{text=substr($$0, 4); next} /^[a-z]+:/{if (text != "") printf "make %-6s %s\n", substr($$1, 1, length($$1)-1), text; text=""}' Makefile

## Create .venv (vLLM 0.34.0) and .venv-0.33 (vLLM 0.33.0) with the project (a few minutes each on two cores).
setup:
	@VENV=$(VENV) VLLM=0.34.0 bash .ci/setup-venv
	@VENV=$(VENV33) VLLM=0.33.0 bash .ci/setup-venv

## Main job (sets up .venv only): the DBO + DSA scenario against the installed vLLM 0.34.0 (CPU: simulated H200; GPU + DeepGEMM: real kernels).
run:
	@VENV=$(VENV) VLLM=0.34.0 bash .ci/setup-venv
	@$(VENV)/bin/dbo-runtime simulate

## CPU tests: unit tests once, the vLLM-facing tests against 0.34.0 and 0.33.0; then lint, types, hygiene (what CI runs).
test: setup
	@rc=0; \
	$(PY) $(PYTEST) tests || rc=1; \
	$(PY33) $(PYTEST) tests/vllm tests/unit/test_install.py || rc=1; \
	{ $(LINT); } || rc=1; \
	exit $$rc

## ruff, mypy, repository hygiene and the layout limits (lines per part, prose share per file) only.
lint:
	$(LINT)
