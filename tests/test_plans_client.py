"""The client side of read plans: shardcache.plan()/Plan, ShardDataset's per-worker plans
and ``shardcache plan``.

Unit tests run against a small real HTTP server on 127.0.0.1 that speaks the proxy's
``/-/plans`` API and serves shards; the end-to-end tests at the bottom run against the
real proxy subprocess."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support.proxy_helpers import Origin, ProxyProcess, make_shard
from support.wait import wait_until

import shardcache
from shardcache.cli import main as cli_main
from shardcache.cli.plan import is_done, plan_rows, status_line
from shardcache.dataset import ShardDataset
from shardcache.plans import PlanError, delete_plan, get_plan, list_plans
from shardcache.workers import WorkerEnvironment

ROOT = Path(__file__).resolve().parent.parent
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def tar_bytes(shard: int, n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(n):
            data = b"shard %d sample %d" % (shard, i)
            info = tarfile.TarInfo(f"s{shard:03d}/k{i:04d}.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class StubProxy:
    """The proxy's ``/-/plans`` API and shard GETs, recording every request.

    ``refuse = (status, body)`` answers every POST with that error. A plan's
    ``position`` advances by ``advance`` on each status GET, so watchers see progress.
    """

    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.files = dict(files or {})
        self.requests: list[dict[str, Any]] = []
        self.plans: dict[str, dict[str, Any]] = {}
        self.refuse: tuple[int, bytes] | None = None
        self.advance = 0
        self.lock = threading.Lock()
        self._n = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, body: Any, ctype: str = "application/json") -> None:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _record(self) -> dict[str, Any]:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                req = {
                    "method": self.command,
                    "path": self.path,
                    "headers": dict(self.headers.items()),
                    "body": json.loads(raw) if raw else None,
                }
                with stub.lock:
                    stub.requests.append(req)
                return req

            def do_POST(self) -> None:  # noqa: N802
                req = self._record()
                if self.path != "/-/plans":
                    return self._answer(404, b"no route\n", "text/plain")
                if stub.refuse is not None:
                    return self._answer(stub.refuse[0], stub.refuse[1], "text/plain")
                body = req["body"]
                with stub.lock:
                    stub._n += 1
                    pid = f"p-{stub._n:08x}"
                    stub.plans[pid] = {
                        "id": pid,
                        "name": body.get("name"),
                        "urls": body["urls"],
                        "shards": len(body["urls"]),
                        "position": 0,
                        "done": False,
                    }
                self._answer(
                    201,
                    {
                        "id": pid,
                        "name": body.get("name"),
                        "shards": len(body["urls"]),
                        "lookahead": {"shards": 8},
                    },
                )

            def do_GET(self) -> None:  # noqa: N802
                req = self._record()
                if self.path == "/-/plans":
                    return self._answer(200, {"plans": [stub.public(p) for p in stub.plans]})
                if self.path.startswith("/-/plans/"):
                    pid = self.path.rsplit("/", 1)[1]
                    with stub.lock:
                        plan = stub.plans.get(pid)
                        if plan is not None:
                            plan["position"] = min(plan["position"] + stub.advance, plan["shards"])
                            plan["done"] = plan["position"] == plan["shards"]
                    if plan is None:
                        return self._answer(404, f"no plan {pid}\n".encode(), "text/plain")
                    return self._answer(200, stub.public(pid))
                data = stub.files.get(self.path.lstrip("/"))
                if data is None:
                    return self._answer(404, b"not found\n", "text/plain")
                req["plan"] = self.headers.get("X-Shardcache-Plan")
                self._answer(200, data, "application/x-tar")

            def do_DELETE(self) -> None:  # noqa: N802
                self._record()
                pid = self.path.rsplit("/", 1)[1]
                with stub.lock:
                    found = stub.plans.pop(pid, None)
                if found is None:
                    return self._answer(404, f"no plan {pid}\n".encode(), "text/plain")
                self._answer(200, {"removed": True})

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def public(self, pid: str) -> dict[str, Any]:
        p = self.plans[pid]
        return {
            "id": pid,
            "name": p["name"],
            "shards": p["shards"],
            "position": p["position"],
            "ready_ahead_shards": 2,
            "ready_ahead_bytes": 3 << 20,
            "downloading": 1,
            "wait_seconds": 0.25,
            "idle_seconds": 1.0,
            "done": p["done"],
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def of(self, method: str, prefix: str = "/") -> list[dict[str, Any]]:
        with self.lock:
            return [
                r for r in self.requests if r["method"] == method and r["path"].startswith(prefix)
            ]

    def start(self) -> StubProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    files = {f"data/train-{s:03d}.tar": tar_bytes(s, 3 + s) for s in range(8)}
    s = StubProxy(files).start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("SHARDCACHE_PROXY", raising=False)
    monkeypatch.delenv("SHARDCACHE_ADMIN_TOKEN", raising=False)


# -- shardcache.plan() --------------------------------------------------------------------


def test_plan_posts_the_urls_name_and_lookahead(stub):
    urls = [f"/data/train-{i:03d}.tar" for i in (3, 1, 2, 1)]
    p = shardcache.plan(urls, proxy=stub.url, name="job-a/worker-0", lookahead=4)
    assert isinstance(p, shardcache.Plan)
    (post,) = stub.of("POST")
    assert post["path"] == "/-/plans"
    assert post["body"] == {"urls": urls, "name": "job-a/worker-0", "lookahead": 4}
    assert post["headers"]["Content-Type"] == "application/json"
    assert "Authorization" not in post["headers"]
    assert p.id.startswith("p-") and p.shards == 4 and p.urls == urls
    assert p.name == "job-a/worker-0" and p.lookahead == {"shards": 8}
    assert p.headers == {"X-Shardcache-Plan": p.id}
    assert p.id in repr(p)


def test_plan_expands_a_brace_pattern_and_omits_defaults(stub):
    with shardcache.plan(stub.url + "/data/train-{000..002}.tar::/x/y.tar", stub.url) as p:
        assert p.shards == 4
    (post,) = stub.of("POST")
    assert post["body"] == {
        "urls": [stub.url + f"/data/train-{i:03d}.tar" for i in range(3)] + ["/x/y.tar"]
    }


@pytest.mark.parametrize(
    "given, sent", [(4, 4), ("4096", "4096"), ("2GiB", "2GiB"), (" 500M ", "500M")]
)
def test_plan_lookahead_is_a_count_or_a_size(stub, given, sent):
    shardcache.plan(["/a.tar"], stub.url, lookahead=given).close()
    assert stub.of("POST")[0]["body"]["lookahead"] == sent


@pytest.mark.parametrize(
    "bad, exc", [(0, ValueError), (True, TypeError), ("", ValueError), (1.5, TypeError)]
)
def test_plan_refuses_a_bad_lookahead_before_asking(stub, bad, exc):
    with pytest.raises(exc, match="lookahead"):
        shardcache.plan(["/a.tar"], stub.url, lookahead=bad)
    assert stub.requests == []


def test_plan_refuses_no_shards_and_overlong_names(stub):
    with pytest.raises(ValueError, match="no shards"):
        shardcache.plan([], stub.url)
    with pytest.raises(ValueError, match="200"):
        shardcache.plan(["/a.tar"], stub.url, name="x" * 201)
    assert stub.requests == []


def test_bearer_token_from_the_environment(stub, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_ADMIN_TOKEN", "s3cret")
    p = shardcache.plan(["/a.tar"], stub.url)
    p.status()
    p.close()
    for method in ("POST", "GET", "DELETE"):
        (req,) = stub.of(method, "/-/plans")
        assert req["headers"]["Authorization"] == "Bearer s3cret", method


def test_proxy_from_shardcache_proxy(stub, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_PROXY", f"127.0.0.1:{stub.port}")  # host:port is http
    with shardcache.plan(["/a.tar"]) as p:
        assert p.proxy == stub.url
    assert len(stub.of("POST")) == 1 and len(stub.of("DELETE")) == 1


def test_no_proxy_known_says_how_to_give_one():
    with pytest.raises(ValueError, match=r"proxy=.*SHARDCACHE_PROXY"):
        shardcache.plan(["/a.tar"])


@pytest.mark.parametrize(
    "status, body, text",
    [
        (
            400,
            b"too many plans (--max-plans 64): DELETE old ones\n",
            "too many plans (--max-plans 64): DELETE old ones",
        ),
        (413, b"plan of 9 shards exceeds --max-plan-shards 8\n", "--max-plan-shards 8"),
        (400, b'{"error": "no urls or pattern"}', "no urls or pattern"),
        (403, b"mutating admin routes are disabled: set --admin-token\nmore\n", "--admin-token"),
    ],
)
def test_proxy_errors_raise_with_the_proxys_text(stub, status, body, text):
    stub.refuse = (status, body)
    with pytest.raises(PlanError) as info:
        shardcache.plan(["/a.tar"], stub.url)
    assert info.value.status == status
    assert text in str(info.value) and f"HTTP {status}" in str(info.value)
    assert "more" not in str(info.value)  # one line
    assert isinstance(info.value, shardcache.ShardcacheError)


def test_unreachable_proxy_raises_plan_error():
    with pytest.raises(PlanError, match="cannot reach the proxy") as info:
        shardcache.plan(["/a.tar"], "http://127.0.0.1:1")
    assert info.value.status is None


def _one_answer(raw: bytes) -> tuple[str, threading.Thread]:
    """A server on 127.0.0.1 that answers one connection with ``raw`` and closes it."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(raw)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", t


@pytest.mark.parametrize(
    "raw, text",
    [
        (b"garbage\r\n\r\n", "request failed"),
        (b"", "request failed"),
        (b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello", "not JSON"),
        (b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}", "no plan id"),
    ],
)
def test_a_proxy_answering_nonsense_raises_plan_error(raw, text):
    url, t = _one_answer(raw)
    with pytest.raises(PlanError, match=text):
        shardcache.plan(["/a.tar"], url)
    t.join(5)


def test_plan_error_pickles():
    import pickle

    exc = pickle.loads(pickle.dumps(PlanError("http://x/-/plans", "HTTP 400: bad", 400)))
    assert exc.status == 400 and str(exc) == "http://x/-/plans: HTTP 400: bad"


def test_status_and_module_helpers(stub):
    p = shardcache.plan(["/a.tar", "/b.tar"], stub.url, name="n")
    assert p.status()["position"] == 0
    assert get_plan(p.id, stub.url)["id"] == p.id
    assert [x["id"] for x in list_plans(stub.url)] == [p.id]
    delete_plan(p.id, stub.url)
    with pytest.raises(PlanError) as info:
        p.status()
    assert info.value.status == 404
    with pytest.raises(PlanError):
        delete_plan(p.id, stub.url)


def test_close_is_idempotent_and_the_context_manager_closes(stub):
    with shardcache.plan(["/a.tar"], stub.url) as p:
        assert not p.closed
    assert p.closed
    p.close()
    p.close()
    assert len(stub.of("DELETE")) == 1
    assert stub.of("DELETE")[0]["path"] == f"/-/plans/{p.id}"


def test_close_of_a_plan_already_gone_is_quiet(stub, caplog):
    p = shardcache.plan(["/a.tar"], stub.url)
    delete_plan(p.id, stub.url)
    with caplog.at_level(logging.WARNING, "shardcache.plans"):
        p.close()
    assert not caplog.records


def test_close_on_a_vanished_proxy_is_logged_not_raised(caplog):
    stub = StubProxy().start()
    p = shardcache.plan(["/a.tar"], stub.url)
    stub.stop()
    with caplog.at_level(logging.WARNING, "shardcache.plans"):
        p.close()
        p.close()
    assert p.closed
    (record,) = caplog.records
    assert p.id in record.getMessage() and "cannot reach" in record.getMessage()


def test_exception_inside_with_still_closes(stub):
    with pytest.raises(RuntimeError), shardcache.plan(["/a.tar"], stub.url):
        raise RuntimeError("reader failed")
    assert len(stub.of("DELETE")) == 1


# -- ShardDataset ---------------------------------------------------------------------------


def shard_gets(stub: StubProxy) -> list[tuple[str, str | None]]:
    return [(r["path"], r.get("plan")) for r in stub.of("GET", "/data/")]


def test_dataset_registers_its_exact_order_and_sends_the_plan_header(stub):
    urls = [f"{stub.url}/data/train-{i:03d}.tar" for i in range(8)]
    env = WorkerEnvironment(rank=1, world_size=2, worker=1, num_workers=2)
    ds = ShardDataset(urls, shuffle=True, seed=7, env=env, plan=True, plan_name="job")
    expected = ds.shard_urls(env)
    assert expected != [urls[i] for i in (3, 7)]  # shuffled before splitting
    samples = list(ds)
    assert len(samples) == sum(3 + int(u[-7:-4]) for u in expected)
    (post,) = stub.of("POST")
    assert post["body"]["urls"] == expected
    assert post["body"]["name"] == "job/node-1/worker-1"
    assert stub.requests[0]["method"] == "POST"  # before any shard request
    (delete,) = stub.of("DELETE")
    plan_id = delete["path"].rsplit("/", 1)[1]
    assert shard_gets(stub) == [(u[len(stub.url) :], plan_id) for u in expected]
    # the DELETE comes after the last shard request
    assert stub.requests[-1]["method"] == "DELETE"


def test_dataset_plan_epochs_appends_the_next_epochs_orders(stub):
    urls = [f"{stub.url}/data/train-{i:03d}.tar" for i in range(8)]
    env = WorkerEnvironment(rank=0, world_size=1, worker=1, num_workers=2)
    ds = ShardDataset(urls, shuffle=True, seed=5, env=env, plan=True, plan_epochs=3)
    ds.set_epoch(4)
    orders = [ds.shard_urls(env, epoch) for epoch in (4, 5, 6)]
    assert orders[0] == ds.shard_urls(env) and len({tuple(o) for o in orders}) == 3
    samples = list(ds)
    # the reader reads this epoch only; the plan holds this epoch and the next two
    assert len(samples) == sum(3 + int(u[-7:-4]) for u in orders[0])
    (post,) = stub.of("POST")
    assert post["body"]["urls"] == orders[0] + orders[1] + orders[2]
    assert [path for path, _ in shard_gets(stub)] == [u[len(stub.url) :] for u in orders[0]]
    # the plan outlives the iteration (it holds what comes next); the next one replaces it
    assert post["body"]["replace"] is True and post["body"]["name"].endswith("/worker-1")
    assert stub.of("DELETE") == []


def test_dataset_plan_epochs_deletes_the_plan_of_an_abandoned_iteration(stub):
    ds = ShardDataset(f"{stub.url}/data/train-{{000..003}}.tar", plan=True, plan_epochs=2)
    it = iter(ds)
    next(it)
    it.close()
    assert len(stub.of("DELETE")) == 1


def test_plan_replace_needs_a_name(stub):
    with pytest.raises(ValueError, match="name"):
        shardcache.plan([f"{stub.url}/data/train-000.tar"], stub.url, replace=True)
    assert stub.of("POST") == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_dataset_plan_epochs_must_be_a_positive_int(stub, bad):
    with pytest.raises(ValueError, match="plan_epochs"):
        ShardDataset(f"{stub.url}/data/train-000.tar", plan=True, plan_epochs=bad)


def test_dataset_plan_name_defaults_to_the_pid_and_a_token_of_the_dataset(stub):
    urls = f"{stub.url}/data/train-{{000..001}}.tar"
    train, val = ShardDataset(urls, plan=True), ShardDataset(urls, plan=True)
    list(train)
    list(train)  # every epoch (and every worker: the dataset is pickled) keeps the name
    list(val)
    names = [post["body"]["name"] for post in stub.of("POST")]
    assert re.fullmatch(rf"{os.getpid()}-[0-9a-f]{{6}}/worker-0", names[0]), names
    # two datasets of one process never share a name: replace and end_plans() are by name
    assert names[0] == names[1] != names[2]


def test_dataset_plan_lookahead_is_passed_on(stub):
    list(ShardDataset(f"{stub.url}/data/train-000.tar", plan=True, plan_lookahead="1GiB"))
    assert stub.of("POST")[0]["body"]["lookahead"] == "1GiB"


def test_dataset_closes_its_plan_when_abandoned_early(stub):
    ds = ShardDataset(f"{stub.url}/data/train-{{000..007}}.tar", plan=True)
    it = iter(ds)
    next(it)
    assert len(stub.of("POST")) == 1 and not stub.of("DELETE")
    it.close()
    assert len(stub.of("DELETE")) == 1
    assert len(shard_gets(stub)) == 1


def test_dataset_closes_its_plan_when_a_shard_fails(stub):
    ds = ShardDataset(f"{stub.url}/data/train-{{000..009}}.tar", plan=True)
    with pytest.raises(shardcache.HTTPStatusError):
        list(ds)
    assert len(stub.of("DELETE")) == 1


def test_dataset_each_iteration_registers_a_new_plan(stub):
    ds = ShardDataset(f"{stub.url}/data/train-{{000..003}}.tar", shuffle=True, plan=True)
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        list(ds)
        orders.append(ds.shard_urls())
    posts = stub.of("POST")
    assert [p["body"]["urls"] for p in posts] == orders
    assert len(stub.of("DELETE")) == 2 and not stub.plans


def test_dataset_plans_by_default_when_urls_are_on_shardcache_proxy(stub, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_PROXY", stub.url)
    list(ShardDataset(f"{stub.url}/data/train-{{000..001}}.tar"))
    assert len(stub.of("POST")) == 1 and len(stub.of("DELETE")) == 1
    assert all(plan for _, plan in shard_gets(stub))


def test_dataset_does_not_plan_by_default_elsewhere(stub, monkeypatch):
    list(ShardDataset(f"{stub.url}/data/train-{{000..001}}.tar"))  # no SHARDCACHE_PROXY
    monkeypatch.setenv("SHARDCACHE_PROXY", "http://127.0.0.1:1")  # another proxy
    list(ShardDataset(f"{stub.url}/data/train-{{000..001}}.tar"))
    assert not stub.of("POST")
    assert all(plan is None for _, plan in shard_gets(stub))
    assert all("X-Shardcache-Plan" not in r["headers"] for r in stub.of("GET", "/data/"))


def test_dataset_plan_false_opts_out(stub, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_PROXY", stub.url)
    ds = ShardDataset(f"{stub.url}/data/train-{{000..001}}.tar", plan=False)
    assert len(list(ds)) == 3 + 4
    assert not stub.of("POST")


def test_dataset_reads_on_when_the_proxy_refuses_a_default_plan(stub, monkeypatch, caplog):
    monkeypatch.setenv("SHARDCACHE_PROXY", stub.url)
    stub.refuse = (400, b"too many plans (--max-plans 1)\n")
    with caplog.at_level(logging.WARNING, "shardcache.dataset"):
        samples = list(ShardDataset(f"{stub.url}/data/train-{{000..001}}.tar"))
    assert len(samples) == 7
    assert "--max-plans 1" in caplog.text
    assert not stub.of("DELETE")


def test_dataset_plan_true_raises_when_refused(stub):
    stub.refuse = (400, b"too many plans (--max-plans 1)\n")
    with pytest.raises(PlanError, match="--max-plans 1"):
        list(ShardDataset(f"{stub.url}/data/train-{{000..001}}.tar", plan=True))
    assert not shard_gets(stub)


def test_dataset_plan_true_needs_urls_on_one_proxy(tmp_path):
    with pytest.raises(ValueError, match="one shardcache proxy"):
        ShardDataset([str(tmp_path / "a.tar")], plan=True)
    with pytest.raises(ValueError, match="one shardcache proxy"):
        ShardDataset(["http://a:1/x.tar", "http://b:1/y.tar"], plan=True)


def test_dataset_plan_name_leaves_room_for_the_worker(stub):
    with pytest.raises(ValueError, match="plan_name"):
        ShardDataset(f"{stub.url}/data/train-000.tar", plan=True, plan_name="x" * 151)


def test_dataset_with_a_bad_shardcache_proxy_does_not_plan(stub, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_PROXY", "ftp://nowhere")
    assert len(list(ShardDataset(f"{stub.url}/data/train-000.tar"))) == 3
    assert not stub.of("POST")


@pytest.mark.torch
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed: no DataLoader workers")
def test_dataloader_workers_register_their_own_plans(stub):
    from torch.utils.data import DataLoader

    urls = [f"{stub.url}/data/train-{i:03d}.tar" for i in range(8)]
    ds = ShardDataset(urls, shuffle=True, seed=3, plan=True, plan_name="job-b")
    keys = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
    assert len(keys) == sum(3 + s for s in range(8)) == len(set(keys))
    posts = {p["body"]["name"]: p["body"]["urls"] for p in stub.of("POST")}
    order = list(urls)
    import random

    random.Random(3).shuffle(order)
    assert posts == {"job-b/worker-0": order[0::2], "job-b/worker-1": order[1::2]}
    # each worker read exactly its plan's order, carrying its plan's id
    wait_until(lambda: len(stub.of("DELETE")) >= 2, 10, what="both plans deleted")
    ids = [d["path"].rsplit("/", 1)[1] for d in stub.of("DELETE")]
    assert len(ids) == 2 and not stub.plans
    by_plan: dict[str, list[str]] = {}
    for path, pid in shard_gets(stub):
        by_plan.setdefault(pid, []).append(stub.url + path)
    assert sorted(by_plan) == sorted(ids)
    assert sorted(by_plan.values()) == sorted(posts.values())


# -- the command line ----------------------------------------------------------------------


def test_status_line_and_rows():
    st = {
        "id": "p-1",
        "name": "j",
        "shards": 10,
        "position": 4,
        "ready_ahead_shards": 3,
        "ready_ahead_bytes": 3 << 20,
        "downloading": 2,
        "wait_seconds": 1.25,
        "idle_seconds": 2,
        "done": False,
    }
    assert status_line(st) == (
        "4/10 shards read, 3 ready ahead (3.0 MiB), 2 downloading, stalled 1.2 s"
    )
    assert plan_rows([st]) == [("p-1", "j", "4/10", "3 (3.0 MiB)", 2, "1.2", "2", "no")]
    assert not is_done(st) and is_done(dict(st, position=10)) and is_done(dict(st, done=True))
    assert status_line({}) == "0/0 shards read, 0 ready ahead (0 B), 0 downloading, stalled 0.0 s"


def test_cli_registers_and_prints_the_id(stub, capsys):
    rc = cli_main(
        [
            "plan",
            "/data/train-{000..003}.tar",
            "--proxy",
            stub.url,
            "--name",
            "n",
            "--lookahead",
            "3",
        ]
    )
    out = capsys.readouterr().out.strip()
    assert rc == 0 and out in stub.plans  # not a terminal: no watching, the plan stays
    assert stub.of("POST")[0]["body"] == {
        "urls": [f"/data/train-{i:03d}.tar" for i in range(4)],
        "name": "n",
        "lookahead": 3,
    }


def test_cli_watch_follows_until_done_then_deletes(stub, capsys):
    stub.advance = 2
    rc = cli_main(
        ["plan", "/data/train-{000..003}.tar", "--proxy", stub.url, "--watch", "--interval", "0.01"]
    )
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0].startswith("p-")
    assert out[1:] == [
        "2/4 shards read, 2 ready ahead (3.0 MiB), 1 downloading, stalled 0.2 s",
        "4/4 shards read, 2 ready ahead (3.0 MiB), 1 downloading, stalled 0.2 s, done",
    ]
    assert not stub.plans and len(stub.of("DELETE")) == 1


def test_cli_watch_keep_leaves_the_plan(stub, capsys):
    stub.advance = 4
    rc = cli_main(["plan", "/data/train-{000..003}.tar", "--proxy", stub.url, "--watch", "--keep"])
    assert rc == 0 and len(stub.plans) == 1 and not stub.of("DELETE")


def test_cli_watch_reports_a_plan_gone(stub, capsys):
    stub.refuse = None
    # a plan deleted behind the watcher's back
    threading.Timer(0.2, lambda: stub.plans.clear()).start()
    rc = cli_main(["plan", "/a.tar", "--proxy", stub.url, "--watch", "--interval", "0.05"])
    assert rc == 1
    assert "is gone" in capsys.readouterr().err


def test_cli_list_and_delete(stub, capsys):
    p = shardcache.plan(["/a.tar", "/b.tar"], stub.url, name="job-c")
    assert cli_main(["plan", "--list", "--proxy", stub.url]) == 0
    out = capsys.readouterr().out
    assert p.id in out and "job-c" in out and "0/2" in out
    assert cli_main(["plan", "--list", "--json", "--proxy", stub.url]) == 0
    assert json.loads(capsys.readouterr().out)[0]["id"] == p.id
    assert cli_main(["plan", "--delete", p.id, "--proxy", stub.url]) == 0
    assert not stub.plans
    assert cli_main(["plan", "--delete", p.id, "--proxy", stub.url]) == 1
    assert f"no plan {p.id}" in capsys.readouterr().err


def test_cli_proxy_refusing_shows_its_text(stub, capsys):
    stub.refuse = (400, b"too many plans (--max-plans 64): DELETE old ones\n")
    assert cli_main(["plan", "/a.tar", "--proxy", stub.url]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardcache plan: error:") and "--max-plans 64" in err
    assert len(err.splitlines()) == 1


def test_cli_needs_a_pattern(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["plan"])
    assert info.value.code == 2 and "PATTERN" in capsys.readouterr().err


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "shardcache", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=full,
    )


@pytest.mark.parametrize("args", [["/a.tar"], ["--list"], ["--delete", "p-1"]])
def test_cli_without_a_running_proxy_says_so_in_one_line(args):
    from support.proxy_helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    res = cli("plan", *args, "--proxy", url)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"no proxy answers at {url}" in lines[0] and "shardcache serve" in lines[0]
    assert res.stdout == ""


# -- end to end, against the real proxy -------------------------------------------------------

SERVER_HAS_PLANS = '"/-/plans"' in (ROOT / "proxy" / "app.py").read_text()
e2e = pytest.mark.skipif(not SERVER_HAS_PLANS, reason="the proxy has no /-/plans routes yet")


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[bytes, str]:
    import urllib.request

    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read(), resp.headers.get("X-Cache", "")


E2E_SHARDS = {f"data/train-{i:03d}.tar": make_shard(4, seed=i) for i in range(6)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An origin with E2E_SHARDS and one proxy in front of it (also a bucket ``data``)."""
    tmp = tmp_path_factory.mktemp("plans")
    origin = Origin(files=dict(E2E_SHARDS)).start()
    proxy = ProxyProcess(
        tmp / "cache",
        "--upstream",
        origin.url,
        "--upstream",
        f"bucket={origin.url}/data",
        "--max-plan-shards",
        "50",
    ).start()
    yield origin, proxy
    proxy.stop()
    origin.stop()


@pytest.fixture
def fresh(served):
    """The served pair with an empty cache, no plans and a clean origin count."""
    origin, proxy = served
    for p in list_plans(proxy.url):
        delete_plan(p["id"], proxy.url)
    import urllib.request

    req = urllib.request.Request(f"{proxy.url}/-/cache", method="DELETE")
    urllib.request.urlopen(req, timeout=10).close()
    origin.gets.clear()
    return origin, proxy


def _metric(proxy_url: str, name: str) -> float:
    text, _ = _get(f"{proxy_url}/metrics")
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@e2e
def test_e2e_plan_downloads_ahead_and_follows_the_reader(fresh):
    origin, proxy = fresh
    urls = [f"{proxy.url}/data/train-{i:03d}.tar" for i in (2, 0, 1, 3)]
    with shardcache.plan(urls, proxy.url, name="e2e/worker-0", lookahead=2) as p:
        assert p.shards == 4
        first = p.status()
        assert first["name"] == "e2e/worker-0" and first["shards"] == 4
        assert first["position"] == 0 and not first["done"]
        # the proxy fetches the first shards of the plan before anyone asks
        assert wait_until(lambda: p.status()["ready_ahead_shards"] >= 2, 15), p.status()
        assert origin.gets["data/train-002.tar"] == 1 and origin.gets["data/train-000.tar"] == 1
        for i, url in enumerate(urls):
            body, cache = _get(url, p.headers)
            assert body == E2E_SHARDS[url.split("/", 3)[3]]
            assert p.status()["position"] == i + 1
        st = p.status()
        assert st["done"] and st["planned_hits"] >= 2
        assert sum(origin.gets.values()) == 4  # every shard came over the network once
        assert [x["id"] for x in list_plans(proxy.url)] == [p.id]
    assert list_plans(proxy.url) == []
    with pytest.raises(PlanError) as info:
        p.status()
    assert info.value.status == 404
    assert _metric(proxy.url, "shardcache_plan_requests_total") >= 4


@e2e
def test_e2e_webdataset_unmodified_with_a_plan(fresh):
    """No header: the proxy matches the requests to the plan by position."""
    import webdataset as wds

    origin, proxy = fresh
    pattern = f"{proxy.url}/data/train-{{000..005}}.tar"
    with shardcache.plan(pattern, proxy.url) as p:
        samples = list(wds.WebDataset(pattern, shardshuffle=False))
        st = p.status()
    assert len(samples) == 6 * 4
    assert st["position"] == 6 and st["done"]


@e2e
def test_e2e_upstream_and_s3_urls_in_a_plan(fresh):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    origin, proxy = fresh
    with shardcache.plan(
        [f"{origin.url}/data/train-000.tar", "s3://bucket/train-001.tar", "/data/train-002.tar"],
        proxy.url,
    ) as p:
        _get(f"{proxy.url}/data/train-000.tar")
        assert p.status()["position"] == 1
        s3 = boto3.client(
            "s3",
            endpoint_url=proxy.url,
            region_name="us-east-1",
            config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}),
        )
        body = s3.get_object(Bucket="bucket", Key="train-001.tar")["Body"].read()
        assert body == E2E_SHARDS["data/train-001.tar"]
        assert p.status()["position"] == 2


@e2e
def test_e2e_shard_dataset_plans_itself(fresh, monkeypatch):
    origin, proxy = fresh
    monkeypatch.setenv("SHARDCACHE_PROXY", proxy.url)
    ds = ShardDataset(f"{proxy.url}/data/train-{{000..005}}.tar", shuffle=True, plan_name="ds")
    it = iter(ds)
    next(it)
    (plan,) = list_plans(proxy.url)
    assert plan["name"] == "ds/worker-0" and plan["shards"] == 6 and plan["position"] == 1
    assert len(list(it)) == 6 * 4 - 1
    assert list_plans(proxy.url) == []


@e2e
def test_e2e_shard_dataset_plans_the_next_epoch_too(fresh, monkeypatch):
    origin, proxy = fresh
    monkeypatch.setenv("SHARDCACHE_PROXY", proxy.url)
    ds = ShardDataset(f"{proxy.url}/data/train-{{000..005}}.tar", shuffle=True, plan_epochs=2)
    other = shardcache.plan(["/data/train-000.tar"], proxy.url, name="someone-else")
    mine = lambda: [p for p in list_plans(proxy.url) if p["id"] != other.id]  # noqa: E731
    it = iter(ds)
    next(it)
    (plan,) = mine()
    assert plan["shards"] == 12 and plan["position"] == 1
    assert len(list(it)) == 6 * 4 - 1
    # read to its end, the plan stays: it holds epoch 2, until epoch 2's plan replaces it
    (kept,) = mine()
    assert kept["id"] == plan["id"] and kept["position"] == 6
    ds.set_epoch(1)
    it = iter(ds)
    next(it)
    (plan2,) = mine()
    assert plan2["id"] != plan["id"] and plan2["name"] == plan["name"]
    assert plan2["position"] == 1
    assert len(list(it)) == 6 * 4 - 1
    assert ds.end_plans() == 1
    assert mine() == [] and [p["id"] for p in list_plans(proxy.url)] == [other.id]
    other.close()


@e2e
def test_e2e_refusals_carry_the_proxys_text(fresh):
    origin, proxy = fresh
    with pytest.raises(PlanError) as info:
        shardcache.plan(["http://elsewhere.example/x.tar"], proxy.url)
    assert info.value.status == 400 and "elsewhere.example" in str(info.value)
    with pytest.raises(PlanError) as info:
        shardcache.plan([f"/data/train-{i:03d}.tar" for i in range(51)], proxy.url)
    assert info.value.status == 413 and "--max-plan-shards" in str(info.value)
    with pytest.raises(PlanError) as info:
        shardcache.plan(["/data/train-000.tar"], proxy.url, lookahead="lots")
    assert info.value.status == 400 and "lookahead" in str(info.value)


@e2e
def test_e2e_cli_register_list_delete(fresh):
    origin, proxy = fresh
    res = cli("plan", "/data/train-{000..002}.tar", "--proxy", proxy.url, "--name", "cli")
    assert res.returncode == 0, res.stderr
    plan_id = res.stdout.strip()
    res = cli("plan", "--list", env={"SHARDCACHE_PROXY": proxy.url})
    assert res.returncode == 0, res.stderr
    assert plan_id in res.stdout and "cli" in res.stdout and "0/3" in res.stdout
    res = cli("plan", "--delete", plan_id, "--proxy", proxy.url)
    assert res.returncode == 0, res.stderr
    assert list_plans(proxy.url) == []


@e2e
def test_e2e_cli_replace_takes_over_a_named_plan(fresh):
    origin, proxy = fresh
    first = cli("plan", "/data/train-{000..002}.tar", "--proxy", proxy.url, "--name", "job")
    assert first.returncode == 0, first.stderr
    res = cli("plan", "/data/train-000.tar", "--proxy", proxy.url, "--replace")
    assert res.returncode == 1 and "name" in res.stderr  # nothing to replace without one
    res = cli(
        "plan", "/data/train-{001..002}.tar", "--proxy", proxy.url, "--name", "job", "--replace"
    )
    assert res.returncode == 0, res.stderr
    assert [(p["id"], p["shards"]) for p in list_plans(proxy.url)] == [(res.stdout.strip(), 2)]
    delete_plan(res.stdout.strip(), proxy.url)


@e2e
def test_e2e_cli_watch_ends_when_the_reader_is_done(fresh):
    origin, proxy = fresh
    watcher = subprocess.Popen(
        [sys.executable, "-m", "shardcache", "plan", "/data/train-{000..002}.tar"]
        + ["--proxy", proxy.url, "--watch", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert wait_until(lambda: list_plans(proxy.url), 15)
        for i in range(3):
            _get(f"{proxy.url}/data/train-{i:03d}.tar")
        out, err = watcher.communicate(timeout=30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0, err
    assert out.splitlines()[-1].startswith("3/3 shards read") and "done" in out
    assert list_plans(proxy.url) == []


@e2e
def test_e2e_cli_watch_on_a_terminal_shows_a_progress_bar(fresh):
    import pty
    import select

    origin, proxy = fresh
    master, slave = pty.openpty()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "shardcache", "plan", "/data/train-{000..002}.tar"]
        + ["--proxy", proxy.url, "--interval", "0.1"],  # a terminal: watching by default
        stdout=slave,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "160", "TERM": "xterm"},
    )
    os.close(slave)
    chunks: list[bytes] = []

    def drain(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the watcher closed the terminal
                    return
                if not data:
                    return
                chunks.append(data)
            elif watcher.poll() is not None:
                return

    try:
        assert wait_until(lambda: list_plans(proxy.url), 15)
        drain(0.5)
        for i in range(3):
            _get(f"{proxy.url}/data/train-{i:03d}.tar")
            drain(0.3)
        drain(30)
        watcher.wait(timeout=10)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
        os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert watcher.returncode == 0, watcher.stderr.read().decode()
    assert "3/3" in out and "ready ahead" in out and "stalled" in out, out
    assert "\x1b[" in out  # drawn by rich on the terminal, not the plain lines of a pipe
    assert list_plans(proxy.url) == []


@e2e
def test_e2e_admin_token(tmp_path, monkeypatch):
    origin = Origin(files=dict(E2E_SHARDS)).start()
    proxy = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--admin-token", "tok"
    ).start()
    try:
        with pytest.raises(PlanError) as info:
            shardcache.plan(["/data/train-000.tar"], proxy.url)
        assert info.value.status == 401 and "token" in str(info.value)
        monkeypatch.setenv("SHARDCACHE_ADMIN_TOKEN", "tok")
        with shardcache.plan(["/data/train-000.tar"], proxy.url) as p:
            assert p.status()["shards"] == 1
        assert list_plans(proxy.url) == []
    finally:
        proxy.stop()
        origin.stop()


@e2e
@pytest.mark.parametrize("keep", [False, True])
def test_e2e_cli_ctrl_c_deletes_the_plan_unless_keep(fresh, keep):
    import signal

    origin, proxy = fresh
    watcher = subprocess.Popen(
        [sys.executable, "-m", "shardcache", "plan", "/data/train-{000..002}.tar"]
        + ["--proxy", proxy.url, "--watch", "--interval", "0.1"]
        + (["--keep"] if keep else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # a test run started in the background inherits SIGINT ignored; a terminal's
        # Ctrl-C reaches a foreground command with the default disposition
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert watcher.stdout is not None
        plan_id = watcher.stdout.readline().strip()  # registered
        assert watcher.stdout.readline().startswith("0/3 shards read")  # watching
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 130, err
    assert [p["id"] for p in list_plans(proxy.url)] == ([plan_id] if keep else [])
