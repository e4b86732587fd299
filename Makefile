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

.PHONY: demo test test-fast test-torch test-clients test-http test-s3compat test-compat lint bench clean

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

# The edit-test loop: the modules marked `fast` (decisions, policies, the settings table,
# URLs, tar iterators, codec, import layers...), less their tests also marked `slow`;
# under a minute here. Only the files that carry the marker are collected (collecting
# all of tests/ imports every S3 and cloud client). `make test` runs everything.
FAST_TESTS = $(shell grep -l "pytest.mark.fast" tests/test_*.py tests/*/test_*.py)
test-fast: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs -p no:cacheprovider -m "fast and not slow and not clients" $(FAST_TESTS)

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

# The public HTTP cache test suite (the one behind cache-tests.fyi) against the proxy, in
# the --revalidate modes never, always and http: CACHE_TESTS_DIR names a checkout of
# github.com/http-tests/cache-tests with `npm install --omit=dev` run in it (node 20+).
# Fails when a required test fails that bench/http_cache_tests_known.json does not list
# with its reason; docs/http-cache-tests.md has the score and the list.
CACHE_TESTS_DIR ?=
test-http:
ifeq ($(CACHE_TESTS_DIR),)
	@echo "test-http skipped: CACHE_TESTS_DIR is not set (a checkout of" \
	  "github.com/http-tests/cache-tests with its npm dependencies installed)"
else
	$(MAKE) $(VENV)/.installed-test
	$(PY) bench/http_cache_tests.py --suite "$(CACHE_TESTS_DIR)"
endif

# The public S3 compatibility suite (github.com/ceph/s3-tests) against the S3 front in
# front of SeaweedFS, with the suite's requirements in $(S3TESTS_VENV): S3_TESTS_DIR names
# a checkout. Fails when a read test the store passes fails through the front and
# bench/s3_compat_known.json does not list it with its reason; docs/s3-front.md has the
# score and the list.
S3_TESTS_DIR ?=
S3TESTS_VENV := .venv-s3tests
test-s3compat:
ifeq ($(wildcard $(S3_TESTS_DIR)/s3tests/functional/test_s3.py),)
	@echo "test-s3compat skipped: S3_TESTS_DIR does not name a checkout of" \
	  "github.com/ceph/s3-tests (got '$(S3_TESTS_DIR)')"
else
	$(MAKE) $(VENV)/.installed-test
	test -f $(S3TESTS_VENV)/.installed || ( $(PYTHON) -m venv $(S3TESTS_VENV) && \
	  grep -v '^tox' "$(S3_TESTS_DIR)/requirements.txt" > $(S3TESTS_VENV)/requirements.txt && \
	  $(S3TESTS_VENV)/bin/pip install --quiet -r $(S3TESTS_VENV)/requirements.txt \
	    pytest-timeout && touch $(S3TESTS_VENV)/.installed )
	$(PY) bench/s3_compat.py --suite "$(S3_TESTS_DIR)" --suite-python $(S3TESTS_VENV)/bin/python
endif

# The lowest aiohttp that pyproject.toml allows, in a venv of its own made afresh: every
# probe of shardcache.compat and the proxy serving a miss and a hit (tests/test_compat.py).
# Shows the declared lower bound is true; not part of `make test` (it installs a venv).
COMPAT_VENV := .venv-compat
test-compat:
	rm -rf $(COMPAT_VENV)
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet -e . pytest pytest-timeout \
	  "aiohttp==$$($(PYTHON) tests/lowest.py aiohttp)"
	$(COMPAT_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests/test_compat.py

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed-test
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) $(COMPAT_VENV) $(S3TESTS_VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
