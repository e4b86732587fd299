"""Store faults for the tests: a tmpfs that the test mounts and fills, and a proxy
started where it is expected to refuse to start (shared by the disk-full, passthrough,
S3 passthrough and revalidation tests)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .proxy import ProxyProcess

KiB = 1 << 10
MiB = 1 << 20


class Rig:
    """Mounts and proxies of one test; the teardown kills the proxies before it unmounts."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.mounts: list[Path] = []
        self.proxies: list[ProxyProcess] = []
        self.immutable: list[Path] = []

    def mount_tmpfs(self, name: str, options: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        where = self.tmp_path / name
        where.mkdir()
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
        self.mounts.append(where)
        return where

    def proxy(self, cache_dir: Path, *args: str, env: dict[str, str] | None = None):
        p = ProxyProcess(cache_dir, *args, env=env)
        p.log_path = self.tmp_path / f"proxy-{len(self.proxies)}.log"  # never on the tmpfs
        self.proxies.append(p)
        return p.start()

    def close(self) -> None:
        for p in self.proxies:
            with contextlib.suppress(Exception):
                p.stop(signal.SIGKILL)
        for f in self.immutable:
            subprocess.run(["chattr", "-i", str(f)], capture_output=True, timeout=30)
        for where in reversed(self.mounts):
            for _ in range(50):
                res = subprocess.run(["umount", str(where)], capture_output=True, timeout=30)
                if res.returncode == 0:
                    break
                time.sleep(0.1)
            else:
                subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(path: Path) -> int:
    """Append to ``path`` until the filesystem says ENOSPC; return the bytes written."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (MiB, 64 * KiB, 4 * KiB, 512, 1):
            block = b"\0" * size
            while True:
                try:
                    n = os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += n
                if n < size:
                    break
    finally:
        os.close(fd)
    return written


def run_serve(*args: str, timeout: float = 30, env: dict[str, str] | None = None):
    """``shardcache serve`` that is expected to fail at startup: (rc, output, served).

    If it starts listening instead, it is killed and ``served`` is True."""
    cmd = [sys.executable, "-m", "shardcache", "serve", "--port", "0", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **(env or {})),
    )
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        rc = None
    reader.join(10)
    text = b"".join(out).decode(errors="replace")
    return rc, text, "serving on" in text
