# The two commands that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
# A CPU build of torch shipped on the machine, if any: the DataLoader tests use it
# (they skip with a message without torch).
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-*+cpu-cp311-*.whl))
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The heavy S3 clients (s3torchconnector, mosaicml-streaming, litdata) get a venv of their
# own: they need torchvision, which PyPI builds against PyPI's (CUDA) torch only, and
# would replace the CPU torch of $(VENV).
CLIENTS_VENV := .venv-clients

.PHONY: demo test test-clients lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet -e '.[test]'
	@if [ -n "$(TORCH_WHEEL)" ]; then \
	  $(PIP) install --quiet "$(TORCH_WHEEL)" || echo "torch wheel not installable here: torch tests skip"; \
	fi
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/shardcache demo

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider -m "not clients"

$(CLIENTS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/pip install --quiet -e '.[test,clients]'
	touch $@

# Real third-party S3 clients through the S3 front, the heavy ones (tests marked `clients`).
test-clients: $(CLIENTS_VENV)/.installed
	$(CLIENTS_VENV)/bin/python -m pytest -q -p no:cacheprovider -m clients tests/s3

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed-test
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
