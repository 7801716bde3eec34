# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make demo   - create .venv, install, run the default secure training on an embedded data set
#   make test   - install if needed, run the test suite (long experiments are skipped)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test test-slow lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch first, pinned to the CPU build available locally; the project itself asks for torch>=2.2
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/securevfl demo --out runs/demo

test: install
	$(BIN)/python -m pytest -q -m "not slow" tests

test-slow: install
	$(BIN)/python -m pytest -q -m slow tests

lint: install
	$(BIN)/ruff check crypto transport securevfl tests bench

# the whole report (bench/results/report/report.md); `make bench QUICK=1` for the smoke-sized one
bench: install
	$(BIN)/securevfl bench $(if $(QUICK),--quick --out bench/results/report/quick,--out bench/results/report)

clean:
	rm -rf $(VENV) runs .pytest_cache
