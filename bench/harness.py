"""What the benchmark scripts share: processes started in groups of their own and stopped
however a run ends, the page cache synced and dropped before a cold run, contenders run
in interleaved rounds, medians, and markdown tables of targets.

A script's run has one shape (the frames unwind in reverse: processes stopped, then the
directories removed, then an interrupt reported)::

    procs = Procs()
    with interruptible() as interrupted, workdirs(args, need, "prefix-") as (tmp, data), procs:
        res = bench(args, tmp, data, procs)   # servers started with procs.start
    if interrupted:
        return INTERRUPTED
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
INTERRUPTED = 130  # the exit status of a run stopped by ^C or SIGTERM

# ---------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until something accepts connections on 127.0.0.1:``port``; fails with the tail of
    ``log`` when ``proc`` exits first, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout:.0f} s")


def spawn(
    argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.Popen:
    """``argv`` started as the leader of a process group of its own, its output appended
    to ``log``."""
    with open(log, "ab") as f:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=str(cwd),
        )


def stop_group(p: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the process group ``p`` leads, SIGKILL when ``p`` has not exited after
    ``timeout`` seconds."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


# ---------------------------------------------------------------------------------------
# the page cache

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def settle(drop: bool = True) -> float:
    """Before a cold start: ``sync`` (so that no system pays for writes another one left
    dirty), then drop the page cache when permitted (root) and ``drop`` is set. Returns the
    seconds ``sync`` took, which is the writeback the previous run left behind."""
    t = time.monotonic()
    os.sync()
    took = time.monotonic() - t
    if drop:
        try:
            DROP_CACHES.write_text("3\n")
        except OSError:
            pass
    return took


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def http_status(url: str, timeout: float = 2.0, method: str = "GET") -> int | None:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def http_headers(url: str, timeout: float = 5.0) -> dict[str, str]:
    req = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(r.headers)


# ---------------------------------------------------------------------------------------
# nginx

NGINX_HEAD = """
worker_processes {workers};
{user}
events {{ worker_connections {connections}; }}
http {{
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
"""


def nginx_argv(
    nginx: str, tmp: Path, http: str, workers: int | str = 1, connections: int = 1024
) -> list[str]:
    """Writes ``tmp/nginx.conf``: ``workers`` worker processes of ``connections`` each (as
    root when run by root), every temporary path under ``tmp``, then ``http``, the rest of
    its http block. Returns the command that runs ``nginx`` on it in the foreground, with
    its pid file and error log in ``tmp``."""
    for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi", "cache", "logs"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    user = "user root;" if os.geteuid() == 0 else ""
    head = NGINX_HEAD.format(workers=workers, user=user, connections=connections, tmp=tmp)
    conf = tmp / "nginx.conf"
    conf.write_text(head + http + "}\n")
    g = f"daemon off; pid {tmp}/nginx.pid; error_log {tmp}/error.log warn;"
    return [nginx, "-p", str(tmp), "-c", str(conf), "-g", g]


# ---------------------------------------------------------------------------------------
# process groups and cleanup


class Procs:
    """Every process this script starts, each the leader of its own process group, so
    that stopping it also stops its workers (nginx, varnishd children)."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        p = spawn(argv, log, env)
        self.live.append(p)
        return p

    def stop(self, p: subprocess.Popen, timeout: float = 15.0) -> None:
        stop_group(p, timeout)
        # workers of a group whose leader exited
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        if p in self.live:
            self.live.remove(p)

    def stop_all(self) -> None:
        for p in list(self.live):
            with contextlib.suppress(Exception):
                self.stop(p, timeout=5.0)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def check_alive(p: subprocess.Popen, name: str, log: Path) -> bool:
    if p.poll() is not None:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")
    return True


class RssSampler:
    """Peak VmRSS of one process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_kib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        path = f"/proc/{self.pid}/status"
        while not self._stop.is_set():
            try:
                with open(path) as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            self.peak_kib = max(self.peak_kib, int(line.split()[1]))
                            self.samples += 1
                            break
            except OSError:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# ---------------------------------------------------------------------------------------
# rounds, medians, tables


def rotated(items: list, r: int) -> list:
    """Round r runs the contenders in turn, alternating direction between rounds."""
    return list(items) if r % 2 == 0 else list(reversed(items))


def say(msg: str) -> None:
    print(msg, flush=True)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------------------
# where the data goes, what the processes cost


def tmpfs_parent(need: int, fallback: str | None) -> str | None:
    """Where the origin's data goes: ``/dev/shm`` when it is writable with room for
    ``need`` bytes twice over (dropping the page cache before each cold start then leaves
    the origin's files in RAM, so every system reads the same fast origin and only the
    caches touch the disk), else ``fallback``."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
    except OSError:
        return fallback
    if os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize > 2 * need:
        return shm
    return fallback


def group_cpu_seconds(pgid: int | None) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (each
    server this script starts leads its own group: nginx's master and workers, varnishd's
    manager and child, the proxy and its threads)."""
    if pgid is None:
        return 0.0
    ticks = 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------
# targets tables


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ratio(a: float | None, z: float | None) -> float | None:
    return None if a is None or not z else a / z


def target_row(
    measure: str,
    mine: str,
    theirs: str,
    r: float | None,
    op: str,
    target: float,
    unit: str = "x",
    spec: str = ".2f",
) -> list[str]:
    """One row of a targets table: ``r`` compared with ``target`` by ``op`` (>=, <= or =,
    the last to two decimals)."""
    if r is None:
        ok = None
    elif op == ">=":
        ok = r >= target
    elif op == "<=":
        ok = r <= target
    else:
        ok = round(r, 2) == round(target, 2)
    shown = "-" if r is None else f"{r:{spec}}{unit}"
    return [measure, mine, theirs, shown, f"{op} {target:{spec}}{unit}", verdict(ok)]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# command line and the run


def parse_sections(text: str, allowed: tuple[str, ...]) -> list[str]:
    picked = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in picked if x not in allowed]
    if bad or not picked:
        raise argparse.ArgumentTypeError(f"pick from {','.join(allowed)} (got {text!r})")
    return picked


def default_python() -> str:
    venv = ROOT / ".venv/bin/python"
    return str(venv) if venv.exists() else sys.executable


def add_run_options(
    p: argparse.ArgumentParser, cold: str = "cold run", data: str | None = "the origin's data"
) -> None:
    """The options every run has: ``--no-drop-caches`` (``drop_caches``: before each
    ``cold`` only sync), ``--dir`` and, unless ``data`` is None, ``--data-dir`` (what
    :func:`workdirs` reads), ``--json`` and ``--python``."""
    p.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help=f"before each {cold} only sync; by default also drop the page cache (root)",
    )
    p.add_argument("--dir", default=None, help="parent of the temporary directory (caches)")
    if data is not None:
        p.add_argument(
            "--data-dir",
            default=None,
            help=f"parent of {data} (default /dev/shm when it has room, else --dir)",
        )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--python",
        default=default_python(),
        help="interpreter that runs the proxy (default .venv/bin/python)",
    )


@contextlib.contextmanager
def workdirs(args: argparse.Namespace, need: int, prefix: str):
    """(tmp, data): a temporary directory for caches and logs under ``--dir`` and one for
    the origin's data (tmpfs when it has room, see ``tmpfs_parent``); both removed after."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=args.dir))
    parent = args.data_dir or tmpfs_parent(need, args.dir)
    data_root = Path(tempfile.mkdtemp(prefix=prefix + "data-", dir=parent))
    try:
        yield tmp, data_root / "data"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(data_root, ignore_errors=True)


@contextlib.contextmanager
def sigterm_as_interrupt():
    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def drop_caches_allowed(wanted: bool, what: str = "cold starts only sync") -> bool:
    """Whether a run may drop the page cache: ``wanted`` and permitted (root); says so when
    it is wanted but not permitted (``what``: what the run does instead)."""
    if wanted and not can_drop_caches():
        say(f"cannot write /proc/sys/vm/drop_caches (not root?): {what}")
        return False
    return wanted


@contextlib.contextmanager
def interruptible() -> Iterator[list[bool]]:
    """A run's outermost frame: SIGTERM raised as KeyboardInterrupt, and an interrupt
    caught (after the inner frames cleaned up), said, and recorded in the yielded list
    (``[True]``: return :data:`INTERRUPTED`)."""
    interrupted: list[bool] = []
    try:
        with sigterm_as_interrupt():
            yield interrupted
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        interrupted.append(True)
