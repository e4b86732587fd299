# The two commands that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is an optional extra (`.[torch]`, from PyPI, whose build brings some 4 GiB of CUDA
# libraries): `make test` leaves it out and the torch DataLoader tests skip with a message.
# `make test TORCH=1` (or `make test-torch`, the DataLoader tests alone) installs it into
# $(VENV); `make test-clients` runs them in $(CLIENTS_VENV), which has torch anyway.
TORCH ?=
# The heavy S3 clients (s3torchconnector, mosaicml-streaming, litdata) and torch get a
# venv of their own, kept apart from the light $(VENV).
CLIENTS_VENV := .venv-clients

.PHONY: demo test test-torch test-clients lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet -e '.[test]'
	touch $@

$(VENV)/.installed-torch: $(VENV)/.installed-test pyproject.toml
	$(PIP) install --quiet -e '.[test,torch]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/shardcache demo

test: $(VENV)/.installed-test $(if $(TORCH),$(VENV)/.installed-torch)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs -p no:cacheprovider -m "not clients"

# The torch DataLoader tests, with torch installed into $(VENV) from PyPI.
test-torch: $(VENV)/.installed-torch
	$(PY) -m pytest -q -rs -p no:cacheprovider tests/test_dataloader.py tests/test_dataset.py

$(CLIENTS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/pip install --quiet -e '.[test,clients,torch]'
	touch $@

# Real third-party S3 clients through the S3 front, the heavy ones (tests marked `clients`),
# and the torch DataLoader tests (marked `torch`), since this venv has torch.
test-clients: $(CLIENTS_VENV)/.installed
	$(CLIENTS_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider -m "clients or torch" \
	  tests/s3 tests/test_dataloader.py tests/test_dataset.py tests/test_plans_client.py

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed-test
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
