"""``shardcache dbcache build|info|export`` as a subprocess, shards served over real HTTP."""

import functools
import http.server
import json
import os
import subprocess
import sys
import threading

import pytest
from support.data import write_shard

from dbcache import DBCache


class Recorder(http.server.SimpleHTTPRequestHandler):
    paths: list  # set per server

    def do_GET(self):
        self.paths.append(self.path)
        if self.path.startswith("/http://"):  # a proxy: serve the named shard from our dir
            self.path = "/" + self.path.rsplit("/", 1)[-1]
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(directory):
        handler = type("H", (Recorder,), {"paths": []})
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=str(directory))
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler.paths

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def shards(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    samples = []
    for k in range(3):
        part = [
            {"__key__": f"s{k}-{i:03d}", "jpg": os.urandom(200), "cls": str(i).encode()}
            for i in range(10)
        ]
        write_shard(root / f"val-{k:03d}.tar", part)
        samples += part
    return root, samples


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "dbcache", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_build_info_export_round_trip(tmp_path, serve, shards):
    wds = pytest.importorskip("webdataset")
    root, samples = shards
    base, paths = serve(root)
    db = str(tmp_path / "val.db")
    res = run("build", db, base + "/val-{000..002}.tar", "--size", "25")
    assert res.returncode == 0, res.stderr
    assert "25 of 25" in res.stderr or "25 samples" in res.stderr
    assert paths == ["/val-000.tar", "/val-001.tar", "/val-002.tar"]

    res = run("info", db, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["size"] == 25 and info["count"] == 25 and info["codec"] == "safe"
    assert info["format_version"] == 3
    assert info["bytes"] > 25 * 200
    res = run("info", db)
    assert "count:   25 (full)" in res.stdout and "codec:   safe" in res.stdout

    out = str(tmp_path / "out.tar")
    res = run("export", db, out)
    assert res.returncode == 0, res.stderr
    back = list(wds.WebDataset(out, shardshuffle=False))
    assert [s["__key__"] for s in back] == [s["__key__"] for s in samples[:25]]
    for got, want in zip(back, samples[:25], strict=True):
        assert got["jpg"] == want["jpg"] and got["cls"] == want["cls"]
    assert not os.path.exists(out + ".part")

    # building again is a no-op on a full file and fetches nothing
    res = run("build", db, base + "/val-{000..002}.tar", "--size", "25")
    assert res.returncode == 0 and "already full" in res.stderr
    assert len(paths) == 3


def test_build_through_a_proxy(tmp_path, serve, shards):
    root, _ = shards
    proxy, paths = serve(root)
    db = str(tmp_path / "val.db")
    origin = "http://127.0.0.1:9/val-{000..001}.tar"  # nothing listens there
    # a stand-in proxy has no /-/where to tell its upstreams: they are given
    up = "http://127.0.0.1:9"
    res = run("build", db, origin, "--size", "20", "--proxy", proxy, "--upstream", up, "--quiet")
    assert res.returncode == 0, res.stderr
    assert paths == ["/val-000.tar", "/val-001.tar"]
    assert len(DBCache(db, 20)) == 20


def test_build_errors(tmp_path, serve, shards):
    root, _ = shards
    base, _ = serve(root)
    db = str(tmp_path / "val.db")
    res = run("build", db, base + "/val-{000..001}.tar", "--size", "50", "--quiet")
    assert res.returncode == 1
    assert "only 20 distinct samples, fewer than --size 50" in res.stderr
    DBCache(db, 50).close()
    res = run("build", db, base + "/val-000.tar", "--size", "40")
    assert res.returncode == 1
    assert "holds a cache of size 50, opened with size 40" in res.stderr
    res = run("build", str(tmp_path / "x.db"), base + "/missing.tar", "--size", "5", "--quiet")
    assert res.returncode == 1
    assert "missing.tar: HTTP 404" in res.stderr
    assert "Traceback" not in res.stderr


def test_an_origins_error_page_is_not_quoted(tmp_path, serve, shards):
    """http.server answers a 404 with an HTML page: the error gives status and reason."""
    root, _ = shards
    base, _ = serve(root)
    res = run("build", str(tmp_path / "x.db"), base + "/missing.tar", "--size", "5", "--quiet")
    assert res.returncode == 1
    line = res.stderr.strip().splitlines()[-1]
    assert line == f"shardcache dbcache: error: {base}/missing.tar: HTTP 404 File not found"


def test_shards_too_few_for_size_fail_once_without_a_retry_hint(tmp_path, serve, shards):
    """The shards end before --size: one clear error, no "next pass" advice; the file
    this build created is removed (a build with the right --size then just works), one
    that existed keeps its samples, and the message says which."""
    root, _ = shards
    base, _ = serve(root)
    db = tmp_path / "val.db"
    res = run("build", str(db), base + "/val-{000..001}.tar", "--size", "1000")
    assert res.returncode == 1
    assert "next pass" not in res.stderr and "source again" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"shardcache dbcache: error: {db}: the shards hold only 20 distinct samples, fewer "
        "than --size 1000; removed the file this build created: build again with --size 20 "
        "or less, or with more shards"
    )
    assert sorted(os.listdir(tmp_path)) == ["www"]
    res = run("build", str(db), base + "/val-{000..001}.tar", "--size", "20", "--quiet")
    assert res.returncode == 0, res.stderr
    # a file that was there: kept, with what it holds
    old = tmp_path / "old.db"
    DBCache(str(old), 30).close()
    res = run("build", str(old), base + "/val-000.tar", "--size", "30", "--quiet")
    assert res.returncode == 1
    assert res.stderr.strip().endswith(
        "fewer than --size 30; the file keeps its 10 samples: build again with more shards "
        "to fill it"
    )
    assert len(DBCache(str(old), 30)) == 10
    res = run("build", str(old), base + "/val-{000..002}.tar", "--size", "30", "--quiet")
    assert res.returncode == 0, res.stderr
    assert len(DBCache(str(old), 30)) == 30


def test_info_and_export_of_bad_files(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 64)
    for args in (("info", str(junk)), ("export", str(junk), str(tmp_path / "o.tar"))):
        res = run(*args)
        assert res.returncode == 1
        assert res.stderr.strip() == f"shardcache dbcache: error: {junk}: not an SQLite database"
    res = run("info", str(tmp_path / "none.db"))
    assert res.returncode == 1 and "none.db: no such file" in res.stderr
    assert not (tmp_path / "none.db").exists()
    assert not (tmp_path / "o.tar").exists()


def test_export_refuses_keys_a_tar_cannot_hold(tmp_path):
    db = str(tmp_path / "v.db")
    list(DBCache(db, 1, [{"__key__": "a.b", "__url__": "", "x": b"1"}]))
    res = run("export", db, str(tmp_path / "o.tar"))
    assert res.returncode == 1 and "'a.b'" in res.stderr
    assert not (tmp_path / "o.tar").exists() and not (tmp_path / "o.tar.part").exists()


def test_export_does_not_replace_a_file_without_force(tmp_path):
    db = str(tmp_path / "v.db")
    list(DBCache(db, 1, [{"__key__": "k", "__url__": "", "x": b"1"}]))
    out = tmp_path / "o.tar"
    out.write_bytes(b"someone's shard")
    res = run("export", db, str(out))
    assert res.returncode == 1 and f"{out} exists; pass --force to replace it" in res.stderr
    assert out.read_bytes() == b"someone's shard"
    res = run("export", db, db, "--force")
    assert res.returncode == 1 and "the DBCache file itself" in res.stderr
    assert DBCache(db, None).key_exists("k")
    res = run("export", db, str(out), "--force")
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() != b"someone's shard"


def test_build_reports_the_shards_it_read(tmp_path, serve, shards):
    root, _ = shards
    base, paths = serve(root)
    db = str(tmp_path / "val.db")
    res = run("build", db, base + "/val-{000..002}.tar", "--size", "15")
    assert res.returncode == 0, res.stderr
    assert "15 samples held, 2 of 3 shard(s) read" in res.stderr
    assert paths == ["/val-000.tar", "/val-001.tar"]  # the third is never fetched
    res = run("build", db, base + "/val-{000..002}.tar", "--size", "15")
    assert res.returncode == 0 and "already full" in res.stderr
    assert "15 samples held, 0 of 3 shard(s) read" in res.stderr


def test_a_failed_build_leaves_no_empty_file_behind(tmp_path, serve, shards):
    root, _ = shards
    base, _ = serve(root)
    db = tmp_path / "new.db"
    res = run("build", str(db), base + "/missing.tar", "--size", "5", "--quiet")
    assert res.returncode == 1 and "missing.tar: HTTP 404" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["www"]  # no new.db, -wal or -shm
    # a file that was there before stays, whatever the failure
    DBCache(str(db), 5).close()
    res = run("build", str(db), base + "/missing.tar", "--size", "5", "--quiet")
    assert res.returncode == 1 and db.exists()
    assert len(DBCache(str(db), 5)) == 0
    # shards too few for --size: test_shards_too_few_for_size_fail_once_without_a_retry_hint


# -- through a real proxy ------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy_and_origin(tmp_path_factory):
    """A real proxy (``shardcache serve --upstream val=ORIGIN``) in front of a real origin."""
    from support.opshelpers import Origin, ProxyProcess, running

    tmp = tmp_path_factory.mktemp("dbproxy")
    files = {}
    for k in range(3):
        path = tmp / f"val-{k:03d}.tar"
        write_shard(
            path,
            [{"__key__": f"s{k}-{i:03d}", "cls": str(i).encode()} for i in range(10)],
        )
        files[f"/data/val-{k:03d}.tar"] = path.read_bytes()
    with Origin(files) as origin:
        proxy = ProxyProcess(f"val={origin.url}/data", tmp / "cache")
        with running(proxy):
            yield proxy, origin


def test_build_through_a_proxy_with_its_upstreams(tmp_path, proxy_and_origin):
    proxy, origin = proxy_and_origin
    db = str(tmp_path / "val.db")
    pattern = f"{origin.url}/data/val-{{000..002}}.tar"
    up = f"val={origin.url}/data"
    res = run("build", db, pattern, "--size", "30", "--proxy", proxy.url, "--upstream", up)
    assert res.returncode == 0, res.stderr
    assert "30 samples held, 3 of 3 shard(s) read" in res.stderr
    assert all(origin.gets[f"/data/val-{k:03d}.tar"] == 1 for k in range(3))
    assert DBCache(db, 30).key_exists("s2-009")


def test_build_through_a_proxy_asks_it_for_its_upstreams(tmp_path, proxy_and_origin):
    """No --upstream: the proxy's own (``/-/where``) map the URLs to its short paths (the
    absolute-URL form would be refused: this proxy allows no host)."""
    proxy, origin = proxy_and_origin
    db = str(tmp_path / "val.db")
    pattern = f"{origin.url}/data/val-{{000..002}}.tar"
    res = run("build", db, pattern, "--size", "30", "--proxy", proxy.url)
    assert res.returncode == 0, res.stderr
    assert "30 samples held, 3 of 3 shard(s) read" in res.stderr
    assert DBCache(db, 30).key_exists("s2-009")
    # a URL under none of them, of a host the proxy does not allow: said before any fetch
    res = run(
        "build", db + "2", f"{origin.url}/dta/val-000.tar", "--size", "5", "--proxy", proxy.url
    )
    assert res.returncode == 1
    assert (
        f"{origin.url}/dta/val-000.tar is under none of the proxy's upstreams "
        f"(val={origin.url}/data): check the URL for a typo; its host is not one the proxy "
        "allows either (its --allow-host)"
    ) in res.stderr
    assert not os.path.exists(db + "2")


def test_build_through_a_proxy_takes_the_absolute_form_for_a_host_it_allows(tmp_path):
    from support.opshelpers import Origin, ProxyProcess, running

    path = tmp_path / "val-000.tar"
    write_shard(path, [{"__key__": f"a{i}", "cls": b"1"} for i in range(5)])
    with Origin({"/x/val-000.tar": path.read_bytes()}) as origin:
        proxy = ProxyProcess(
            "other=http://data.example/d", tmp_path / "cache", ["--allow-host", "127.0.0.1"]
        )
        with running(proxy):
            db = str(tmp_path / "val.db")
            url = f"{origin.url}/x/val-000.tar"
            res = run("build", db, url, "--size", "5", "--proxy", proxy.url)
            assert res.returncode == 0, res.stderr
            assert origin.gets["/x/val-000.tar"] == 1 and DBCache(db, 5).key_exists("a4")


def test_build_through_a_proxy_shows_the_proxys_error_text(tmp_path, proxy_and_origin):
    proxy, origin = proxy_and_origin
    db = str(tmp_path / "val.db")
    # the proxy's own absolute-URL form, kept as given: refused, the host is not allowed
    url = f"{proxy.url}/{origin.url}/data/val-000.tar"
    res = run("build", db, url, "--size", "5", "--proxy", proxy.url, "--quiet")
    assert res.returncode == 1
    assert "HTTP 403 Forbidden: host 127.0.0.1 is not allowed (see --allow-host)" in res.stderr
    # a path the upstream does not have: the proxy's 404 and its one line
    res = run(
        "build",
        db,
        f"{origin.url}/data/nope.tar",
        "--size",
        "5",
        "--proxy",
        proxy.url,
        "--upstream",
        f"val={origin.url}/data",
        "--quiet",
    )
    assert res.returncode == 1
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"shardcache dbcache: error: {proxy.url}/val/nope.tar: HTTP 404")
    assert len(line) > len(
        f"shardcache dbcache: error: {proxy.url}/val/nope.tar: HTTP 404 Not Found"
    )
    assert not os.path.exists(db)


def test_build_names_a_url_outside_the_upstreams(tmp_path, proxy_and_origin):
    proxy, origin = proxy_and_origin
    db = str(tmp_path / "val.db")
    res = run(
        "build",
        db,
        f"{origin.url}/dta/val-000.tar",
        "--size",
        "5",
        "--proxy",
        proxy.url,
        "--upstream",
        f"val={origin.url}/data",
    )
    assert res.returncode == 1
    assert f"{origin.url}/dta/val-000.tar is under none of --upstream val={origin.url}/data" in (
        res.stderr
    )
    assert not os.path.exists(db)
    res = run("build", db, f"{origin.url}/data/val-000.tar", "--size", "5", "--upstream", "x")
    assert res.returncode == 1 and "--upstream needs --proxy" in res.stderr


def test_build_through_a_proxy_that_is_not_running(tmp_path):
    from support.opshelpers import free_port

    proxy = f"http://127.0.0.1:{free_port()}"
    db = str(tmp_path / "val.db")
    res = run(
        "build",
        db,
        "https://data.example/d/val-000.tar",
        "--size",
        "5",
        "--proxy",
        proxy,
        "--upstream",
        "https://data.example/d",
    )
    assert res.returncode == 1
    assert f"no proxy answers at {proxy}: connection refused" in res.stderr
    assert "shardcache serve" in res.stderr and not os.path.exists(db)
    # without --upstream the proxy is asked first: the message says what to pass instead
    res = run("build", db, "https://data.example/d/val-000.tar", "--size", "5", "--proxy", proxy)
    assert res.returncode == 1 and not os.path.exists(db)
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"shardcache dbcache: error: --proxy {proxy}: cannot ask the proxy")
    assert line.endswith(
        "start it or check --proxy, or give dbcache build the proxy's --upstream values "
        "with --upstream"
    )
