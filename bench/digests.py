"""What checking digests costs a cold read: one object through the proxy from a local
origin, with this tree's proxy against another source tree's (``--base``, e.g. the
commit before digests were checked), interleaved rounds, medians.

    git archive <base-commit> | tar -x -C /tmp/base
    python bench/digests.py --base /tmp/base            # 256 MiB, 7 rounds

The origin (a subprocess: a threaded HTTP/1.1 server in this file) serves ``--size-mib``
MiB of random bytes from tmpfs with ``sendfile``: a 200 with Content-Length, ETag and
Accept-Ranges, a 206 for ``Range: bytes=a-b``. Path ``/plain`` declares no digest
(the proxy computes the crc32c it records), ``/md5`` a Content-MD5 of the whole object
on every answer (the proxy must compute MD5 over every byte, in parts as well; the base
checked it on a one-stream 200 only).

Each run starts a proxy on an empty cache directory (``--dir``, on disk), reads a tiny
object through it (start-up work is not timed), syncs, then times one cold GET of the
whole object read to the end by one client; MB/s = size / wall time. Variants: the
threaded transport (one stream, spliced when nothing is hashed) and ``--http-parts on``
(8 parts of 8 MiB in parallel, written at their offsets).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import rotated, wait_until  # noqa: E402

VARIANTS = {
    "threads": ("--http-transport", "threads"),
    "parts": ("--http-transport", "threads", "--http-parts", "on"),
}


def serve_origin(path: str, port_file: str) -> None:
    """The origin: ``path`` at /plain and /md5 (with Content-MD5), /tiny: 1 KiB."""
    size = os.path.getsize(path)
    h = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    md5 = base64.b64encode(h.digest()).decode()
    etag = '"' + h.hexdigest()[:16] + '"'

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/tiny":
                body = b"x" * 1024
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            start, stop, status = 0, size, 200
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            if m:
                start = int(m.group(1))
                stop = min(size, int(m.group(2)) + 1) if m.group(2) else size
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(stop - start))
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            if self.path == "/md5":
                self.send_header("Content-MD5", md5)
            self.end_headers()
            self.wfile.flush()
            with open(path, "rb") as f:
                pos = start
                while pos < stop:
                    pos += os.sendfile(self.connection.fileno(), f.fileno(), pos, stop - pos)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


def start_proxy(src: Path, cache: Path, origin: str, extra: tuple[str, ...]) -> tuple:
    cmd = [sys.executable, "-m", "shardcache", "serve", "--cache-dir", str(cache)]
    cmd += ["--port", "0", "--upstream", origin, "--min-free", "0", "--cache-size", "4G"]
    cmd += [*extra]
    env = dict(os.environ, PYTHONPATH=str(src))
    log = cache.parent / "proxy.log"
    fh = open(log, "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=src)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"serving on https?://[^:]+:(\d+)", log.read_text(errors="replace"))
        if m:
            return proc, fh, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(log.read_text(errors="replace"))


def get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        n = 0
        buf = bytearray(1 << 20)
        while k := resp.readinto(buf):
            n += k
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status}")
        return n
    finally:
        conn.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(
    src: Path, workdir: Path, origin: str, variant: str, path: str, size: int
) -> tuple[float, float]:
    run = Path(tempfile.mkdtemp(dir=workdir))
    proc, fh, port = start_proxy(src, run / "cache", origin, VARIANTS[variant])
    try:
        get(port, "/tiny")
        os.sync()
        c0 = cpu_seconds(proc.pid)
        t0 = time.perf_counter()
        n = get(port, path)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(proc.pid) - c0
        if n != size:
            raise RuntimeError(f"read {n} of {size} bytes")
        return size / wall / 1e6, cpu
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        fh.close()
        shutil.rmtree(run, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="source tree to compare with")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    obj = shm / f"digests-bench-{os.getpid()}"
    obj.write_bytes(os.urandom(args.size_mib << 20))
    size = obj.stat().st_size
    port_file = shm / f"digests-bench-{os.getpid()}.port"
    origin = subprocess.Popen(
        [sys.executable, __file__, "--origin", str(obj), str(port_file)], cwd=ROOT
    )
    try:
        wait_until(
            lambda: port_file.exists() and port_file.read_text(), 30, "the origin's port file"
        )
        url = f"http://127.0.0.1:{port_file.read_text()}"
        trees = {"base": args.base.resolve(), "digests": ROOT}
        cases = [
            (tree, variant, path)
            for variant in args.variants.split(",")
            for tree in trees
            for path in ("/plain", "/md5")
        ]
        results: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
        cpus: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for case in rotated(cases, r):
                tree, variant, path = case
                rate, cpu = one_run(trees[tree], args.dir, url, variant, path, size)
                results[case].append(rate)
                cpus[case].append(cpu)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        print(f"cold GET of {args.size_mib} MiB, {args.rounds} interleaved rounds, medians")
        print(
            "| transport | object | base MB/s | digests MB/s | ratio | proxy CPU-s base / digests |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for variant in args.variants.split(","):
            for path in ("/plain", "/md5"):
                old = results[("base", variant, path)]
                new = results[("digests", variant, path)]
                a, b = statistics.median(old), statistics.median(new)
                print(
                    f"| {variant} | {path} | {a:.0f} ({min(old):.0f}–{max(old):.0f}) "
                    f"| {b:.0f} ({min(new):.0f}–{max(new):.0f}) | {b / a:.3f} "
                    f"| {statistics.median(cpus[('base', variant, path)]):.2f} / "
                    f"{statistics.median(cpus[('digests', variant, path)]):.2f} |"
                )
    finally:
        origin.terminate()
        origin.wait(10)
        obj.unlink(missing_ok=True)
        port_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--origin":
        serve_origin(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
