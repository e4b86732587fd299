"""A pytest plugin loaded into the S3 compatibility suite's run by bench/s3_compat.py
(``-p s3_compat_plugin``): it tells the harness's router which test is running and in
which phase (only the requests of a test's own body may go to the front; its fixtures'
bucket creation and clean-up always go to the store), and writes each test's verdict.

Environment: ``S3COMPAT_ROUTER`` (the router's base URL), ``S3COMPAT_RESULTS`` (a JSON
lines file: one ``{"test", "when", "outcome", "message"}`` per report)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

_ROUTER = os.environ.get("S3COMPAT_ROUTER", "")
_RESULTS = os.environ.get("S3COMPAT_RESULTS", "")


def _tell(test: str, phase: str) -> None:
    if not _ROUTER:
        return
    body = json.dumps({"test": test, "phase": phase}).encode()
    req = urllib.request.Request(
        _ROUTER + "/__s3compat__/phase",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _tell(item.nodeid, "call")
    try:
        yield
    finally:
        _tell(item.nodeid, "fixture")


def pytest_runtest_logreport(report: Any) -> None:
    if not _RESULTS:
        return
    message = ""
    if report.failed or report.skipped:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            message = crash.message
        elif isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            message = str(report.longrepr[2])
        else:
            message = str(report.longrepr)[-500:]
    line = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "message": message.splitlines()[0][:300] if message else "",
    }
    with open(_RESULTS, "a") as f:
        f.write(json.dumps(line) + "\n")
