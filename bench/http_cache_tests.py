"""The public HTTP cache test suite (the one behind cache-tests.fyi) against the proxy.

    CACHE_TESTS_DIR=/path/to/cache-tests python bench/http_cache_tests.py
    python bench/http_cache_tests.py --suite DIR --modes never    # one --revalidate mode
    python bench/http_cache_tests.py --suite DIR --id vary-star --modes always  # one test, dumped
    python bench/http_cache_tests.py --suite DIR --out /tmp/r      # keep results-<mode>.json
    python bench/http_cache_tests.py --suite DIR --from /tmp/r --markdown docs/http-cache-tests.md \\
        --results docs/http-cache-tests-results.json               # rewrite the committed lists

The suite (https://github.com/http-tests/cache-tests: an origin server, a CLI client and
its tests, node.js) is not part of this repository and not on the npm registry: check it
out anywhere, run ``npm install --omit=dev`` in it, and name its directory with
``--suite`` or ``CACHE_TESTS_DIR``. Without it the script says so and exits 0 (skipped).

For each ``--revalidate`` mode (``--modes``, default ``never,always,http``) it starts the
suite's origin on 127.0.0.1, ``python -m shardcache serve --upstream <origin>`` on an
empty cache directory, and the suite's CLI with the proxy as its base URL, as the suite
tests any reverse proxy. One change (bench/http_cache_tests_preload.mjs, loaded into the
suite's processes): the CLI's own bookkeeping, ``PUT /config/<uuid>`` and ``GET
/state/<uuid>``, goes straight to the origin, since the proxy answers GET and HEAD only
and would fail every test at setup (``--setup-through-proxy`` shows that).

It prints, per mode, passed/total for all tests, the required ones (``kind`` required or
unset), and the required ones outside the freshness groups (``FRESHNESS_GROUPS``), beside
nginx's and Varnish's published results (the suite's ``results/*.json``) counted the same
way; "passed" is the suite's own verdict ``true`` for the test. With ``--known`` (default
bench/http_cache_tests_known.json, the committed list of required tests the proxy fails
and why) it exits 1 when a required test fails that the list does not name for that
mode, and names the listed ones that now pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import free_port, spawn, stop_group, wait_listening  # noqa: E402

PRELOAD = Path(__file__).resolve().parent / "http_cache_tests_preload.mjs"
KNOWN = Path(__file__).resolve().parent / "http_cache_tests_known.json"
MODES = ("never", "always", "http")
REFERENCES = {"nginx": "nginx.json", "Varnish": "varnish.json"}

# Groups (the suite's test-file ids) left out of the "outside freshness" figure: those
# about computing a freshness lifetime (max-age, Expires, Age, heuristics, CDN-Cache-Control)
# or serving stale, plus Cache-Control response directives and If-None-Match, whose
# required tests mostly hinge on a max-age running out. This partition gives the figures
# the proxy is judged by: 85 required tests; nginx passes 60, Varnish 71 (published).
FRESHNESS_GROUPS = frozenset(
    {
        "cc-freshness",
        "cc-parse",
        "age-parse",
        "expires",
        "expires-parse",
        "cc-response",
        "stale",
        "heuristic",
        "conditional-inm",
        "cdn-cache-control",
    }
)

# the suite's metadata, read by node from the suite's own tests/index.mjs
_META_JS = """
import { pathToFileURL } from 'node:url'
const dir = process.argv[1]
const { default: suites } = await import(pathToFileURL(dir + '/tests/index.mjs').href)
const out = []
for (const s of suites) {
  for (const t of s.tests) {
    out.push({ suite: s.id, suite_name: s.name, id: t.id, name: t.name,
      kind: t.kind || 'required', depends_on: t.depends_on || [],
      browser_only: t.browser_only === true })
  }
}
console.log(JSON.stringify(out))
"""


# ---------------------------------------------------------------------------------------
# the suite


def suite_problem(suite: Path | None) -> str | None:
    """Why the suite cannot run, or None."""
    if suite is None:
        return "CACHE_TESTS_DIR is not set (nor --suite)"
    if not (suite / "test-engine" / "cli.mjs").is_file():
        return f"{suite} is not a checkout of http-tests/cache-tests (no test-engine/cli.mjs)"
    if shutil.which("node") is None:
        return "node is not on PATH"
    if not (suite / "node_modules" / "undici").is_dir():
        return (
            f"the suite's dependencies are not installed: run `npm install --omit=dev` in {suite}"
        )
    return None


def suite_meta(suite: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["node", "--input-type=module", "-e", _META_JS, str(suite)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def suite_commit(suite: Path) -> str:
    """The suite's commit: its git checkout's HEAD, or a .suite-commit file beside an export."""
    out = subprocess.run(
        ["git", "-C", str(suite), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if out.returncode == 0:
        return out.stdout.strip()
    with contextlib.suppress(OSError):
        return (suite / ".suite-commit").read_text().strip()
    return "unknown"


def node_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().startswith("npm_")}
    env.update(extra)
    return env


def run_mode(
    suite: Path,
    mode: str,
    tmp: Path,
    test_id: str = "",
    setup_through_proxy: bool = False,
    log_level: str = "warning",
    proxy_args: tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """One run of the suite's CLI through a fresh proxy; its JSON results (None with --id,
    whose dump goes to stdout)."""
    origin_port, proxy_port = free_port(), free_port()
    origin = f"http://127.0.0.1:{origin_port}"
    base = f"http://127.0.0.1:{proxy_port}"
    work = tmp / mode
    work.mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    try:
        env = node_env(
            CACHE_TESTS_LISTEN_HOST="127.0.0.1",
            npm_config_protocol="http",
            npm_config_port=str(origin_port),
            npm_config_pidfile=str(work / "origin.pid"),
        )
        argv = ["node", "--import", PRELOAD.as_uri(), "test-engine/server/server.mjs"]
        procs.append(spawn(argv, work / "origin.log", env, suite))
        wait_listening(origin_port, procs[-1], work / "origin.log", 20.0)
        argv = [sys.executable, "-m", "shardcache", "serve", "--upstream", origin]
        argv += ["--port", str(proxy_port), "--cache-dir", str(work / "cache")]
        argv += ["--revalidate", mode, "--log-level", log_level, *proxy_args]
        procs.append(spawn(argv, work / "proxy.log", dict(os.environ), ROOT))
        wait_listening(proxy_port, procs[-1], work / "proxy.log", 20.0)
        env = node_env(npm_config_base=base, npm_config_id=test_id, npm_package_config_id="")
        if not setup_through_proxy:
            env["CACHE_TESTS_SETUP_ORIGIN"] = origin
        argv = ["node", "--no-warnings", "--import", PRELOAD.as_uri(), "test-engine/cli.mjs"]
        if test_id:
            subprocess.run(argv, env=env, cwd=suite, check=False)
            print(f"--- proxy log ({mode}):\n{(work / 'proxy.log').read_text()[-4000:]}")
            return None
        out = subprocess.run(argv, env=env, cwd=suite, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the suite's CLI exited with {out.returncode}:\n{out.stderr}")
        return json.loads(out.stdout)
    finally:
        for p in reversed(procs):
            stop_group(p, 10)


# ---------------------------------------------------------------------------------------
# counting


def required(meta: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in meta if t["kind"] == "required" and not t["browser_only"]]


def verdict(meta_by_id: dict[str, dict[str, Any]], results: dict[str, Any], tid: str) -> str:
    """The suite's verdict for one test (test-engine/lib/results.mjs, dependencies honoured)."""
    r = results.get(tid)
    if r is None:
        return "untested"
    test = meta_by_id[tid]
    for dep in test["depends_on"]:
        if verdict(meta_by_id, results, dep) not in ("pass", "yes"):
            return "dependency"
    if isinstance(r, list) and r and r[0] == "Setup":
        return "retry" if r[1:2] == ["retry"] else "setup"
    if isinstance(r, list) and r and r[0] == "AbortError":
        return "harness"
    kind = test["kind"]
    if kind == "optimal":
        return "pass" if r is True else "optimal-fail"
    if kind == "check":
        return "yes" if r is True else "no"
    return "pass" if r is True else "fail"


def score(meta: list[dict[str, Any]], results: dict[str, Any]) -> dict[str, list[int]]:
    """passed/total: all tests run, required, required outside the freshness groups."""
    req = required(meta)
    outside = [t for t in req if t["suite"] not in FRESHNESS_GROUPS]
    ran = [t for t in meta if t["id"] in results]

    def count(tests: list[dict[str, Any]]) -> list[int]:
        return [sum(results.get(t["id"]) is True for t in tests), len(tests)]

    return {"all": count(ran), "required": count(req), "required_outside_freshness": count(outside)}


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_PORT = re.compile(r"127\.0\.0\.1:\d+")


def message(result: Any) -> str:
    """The suite's verdict as one line, without the run's uuids and ports (so that the
    committed lists change only when a result does)."""
    if result is True:
        return "passed"
    text = ": ".join(str(x) for x in result) if isinstance(result, list) else str(result)
    return _PORT.sub("127.0.0.1:PORT", _UUID.sub("UUID", text))


def check_known(
    meta: list[dict[str, Any]], mode: str, results: dict[str, Any], known: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """Required tests failing without a listed reason, and listed ones that pass now."""
    listed = known.get(mode, {})
    unlisted, fixed = [], []
    for t in required(meta):
        ok = results.get(t["id"]) is True
        if not ok and t["id"] not in listed:
            unlisted.append(t["id"])
        if ok and t["id"] in listed:
            fixed.append(t["id"])
    return unlisted, fixed


# ---------------------------------------------------------------------------------------
# reports


def markdown(
    meta: list[dict[str, Any]],
    runs: dict[str, dict[str, Any]],
    refs: dict[str, dict[str, Any]],
    known: dict[str, Any],
    suite_commit: str,
) -> str:
    causes = known.get("causes", {})
    mark = {True: "pass", False: "FAIL"}
    lines = [
        "# The HTTP cache test suite against shardcache",
        "",
        "<!-- written by `python bench/http_cache_tests.py --markdown`; the reasons live in",
        "     bench/http_cache_tests_known.json -->",
        "",
        "[http-tests/cache-tests](https://github.com/http-tests/cache-tests) (the suite behind",
        f"[cache-tests.fyi](https://cache-tests.fyi)), commit `{suite_commit[:12]}`, run by",
        "`make test-http` (`bench/http_cache_tests.py`; `CACHE_TESTS_DIR` names a checkout",
        "with its npm dependencies installed). The suite's CLI talks to the proxy as to any",
        "reverse proxy; only its own bookkeeping (`PUT /config`, `GET /state`) goes straight",
        "to its origin, since shardcache answers GET and HEAD only. nginx and Varnish are the",
        "suite's published results, counted the same way. (With the bookkeeping through the",
        "proxy too, `--setup-through-proxy`, every test fails at setup on the 405 to its PUT:",
        '0 passed.) "Outside freshness" leaves out the groups',
        ", ".join(f"`{g}`" for g in sorted(FRESHNESS_GROUPS)) + ".",
        "",
        "## Score (passed / tests)",
        "",
        "| | " + " | ".join([f"shardcache `--revalidate {m}`" for m in runs] + list(refs)) + " |",
        "|---|" + "---|" * (len(runs) + len(refs)),
    ]
    scores = {
        **{m: score(meta, r) for m, r in runs.items()},
        **{n: score(meta, r) for n, r in refs.items()},
    }
    for key, label in (
        ("required_outside_freshness", "required, outside freshness"),
        ("required", "required"),
        ("all", "all"),
    ):
        cells = [f"{scores[k][key][0]} / {scores[k][key][1]}" for k in scores]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Failing required tests, by cause", ""]
    lines.append(
        "A cause of kind *bug* is behaviour to fix in the proxy; *decision* is the product's "
        "choice (shards are immutable unless `--revalidate` says otherwise, a read-only "
        "proxy, the trust rule)."
    )
    tally = {
        m: Counter(
            known.get(m, {}).get(t["id"], "unlisted")
            for t in required(meta)
            if r.get(t["id"]) is not True
        )
        for m, r in runs.items()
    }
    names = sorted(
        {c for t in tally.values() for c in t},
        key=lambda c: (causes.get(c, {}).get("kind", "?"), -sum(t[c] for t in tally.values())),
    )
    lines += ["", "| cause | kind | " + " | ".join(f"`{m}`" for m in runs) + " |"]
    lines.append("|---|---|" + "---|" * len(runs))
    for c in names:
        kind = causes.get(c, {}).get("kind", "?")
        lines.append(f"| {c} | {kind} | " + " | ".join(str(tally[m][c]) for m in runs) + " |")
    for mode, results in runs.items():
        listed = known.get(mode, {})
        failing = [t for t in required(meta) if results.get(t["id"]) is not True]
        by_cause: dict[str, list[dict[str, Any]]] = {}
        for t in failing:
            by_cause.setdefault(listed.get(t["id"], "unlisted"), []).append(t)
        lines += ["", f"### `--revalidate {mode}`: {len(failing)} failing", ""]
        for cause, tests in sorted(by_cause.items(), key=lambda kv: -len(kv[1])):
            c = causes.get(cause, {"kind": "?", "text": "not in the list of known failures"})
            lines += [f"**{cause}** ({c['kind']}, {len(tests)}): {c['text']}", ""]
            lines += [
                "| test | group | what it checks | the suite's message |",
                "|---|---|---|---|",
            ]
            for t in tests:
                name = t["name"].replace("|", "\\|").replace("\n", " ")
                msg = message(results.get(t["id"])).replace("|", "\\|").replace("\n", " ")
                lines.append(f"| `{t['id']}` | {t['suite']} | {name} | {msg[:140]} |")
            lines.append("")
    lines += ["## Every required test", ""]
    lines.append("| test | group | " + " | ".join(list(runs) + list(refs)) + " |")
    lines.append("|---|---|" + "---|" * (len(runs) + len(refs)))
    for t in required(meta):
        cells = [mark[r.get(t["id"]) is True] for r in list(runs.values()) + list(refs.values())]
        lines.append(f"| `{t['id']}` | {t['suite']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", type=Path, default=os.environ.get("CACHE_TESTS_DIR") or None)
    ap.add_argument("--modes", default=",".join(MODES), help="--revalidate values, comma separated")
    ap.add_argument("--id", default="", help="run this one test and dump its exchanges")
    ap.add_argument("--out", type=Path, help="directory for results-<mode>.json and summary.json")
    ap.add_argument("--known", type=Path, default=KNOWN, help="failures listed with reasons")
    ap.add_argument("--markdown", type=Path, help="write the per-test report here")
    ap.add_argument("--results", type=Path, help="write the per-test results of every mode here")
    ap.add_argument("--log-level", default="warning", help="the proxy's --log-level")
    ap.add_argument(
        "--from",
        dest="load",
        type=Path,
        help="read results-<mode>.json from this directory (an earlier --out) instead of running",
    )
    ap.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="one more argument for the proxy (e.g. --proxy-arg=--forward-credentials=*); "
        "the committed figures use none",
    )
    ap.add_argument(
        "--setup-through-proxy",
        action="store_true",
        help="send the suite's PUT /config and GET /state through the proxy too",
    )
    args = ap.parse_args(argv)
    problem = suite_problem(args.suite)
    if problem:
        print(f"http cache tests skipped: {problem}.\n{__doc__.split(chr(10) * 2)[1]}")
        return 0
    suite = args.suite.resolve()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    meta = suite_meta(suite)
    meta_by_id = {t["id"]: t for t in meta}
    commit = suite_commit(suite)
    refs = {}
    for name, file in REFERENCES.items():
        with contextlib.suppress(OSError):
            refs[name] = json.loads((suite / "results" / file).read_text())
    known = json.loads(args.known.read_text()) if args.known and args.known.exists() else {}
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="http-cache-tests-") as tmp:
        for mode in modes:
            if args.load:
                runs[mode] = json.loads((args.load / f"results-{mode}.json").read_text())
                continue
            t0 = time.monotonic()
            results = run_mode(
                suite,
                mode,
                Path(tmp),
                args.id,
                args.setup_through_proxy,
                args.log_level,
                tuple(args.proxy_arg),
            )
            if results is None:
                return 0
            runs[mode] = results
            print(f"--revalidate {mode}: {len(results)} tests in {time.monotonic() - t0:.0f} s")
    summary = {m: score(meta, r) for m, r in runs.items()}
    summary.update({n: score(meta, r) for n, r in refs.items()})
    width = max(len(k) for k in summary)
    for name, s in summary.items():
        label = f"--revalidate {name}" if name in runs else name
        print(
            f"  {label:<{width + 13}} required outside freshness "
            f"{s['required_outside_freshness'][0]:>3}/{s['required_outside_freshness'][1]}"
            f"  required {s['required'][0]:>3}/{s['required'][1]}"
            f"  all {s['all'][0]:>3}/{s['all'][1]}"
        )
    for mode, results in runs.items():
        kinds = Counter(verdict(meta_by_id, results, t["id"]) for t in required(meta))
        print(f"  {mode}: the suite's verdicts, required tests: {dict(sorted(kinds.items()))}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for mode, results in runs.items():
            (args.out / f"results-{mode}.json").write_text(json.dumps(results, indent=1))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.results:
        doc = {"suite_commit": commit, "summary": summary}
        doc.update({m: {k: message(v) for k, v in r.items()} for m, r in runs.items()})
        args.results.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(meta, runs, refs, known, commit))
    status = 0
    for mode, results in runs.items():
        unlisted, fixed = check_known(meta, mode, results, known)
        if fixed:
            print(f"  {mode}: now passing, remove from {args.known}: {' '.join(fixed)}")
        if unlisted:
            status = 1
            print(f"  {mode}: FAILING and not listed in {args.known}: {' '.join(unlisted)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
