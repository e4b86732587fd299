"""The access log at little cost: its lines kept in memory and written together (as
nginx's ``access_log ... buffer= flush=``), at most a second late when the proxy is idle,
before any other line, every one of them at exit (SIGTERM included, and in each process
of ``--workers``), redacted as before; and its records made cheaply, yet as ``logging``
makes them."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import threading
import time
import urllib.request

import pytest
from support.proxy_helpers import Origin, ProxyProcess
from support.wait import wait_until

from proxy.logs import (
    DAEMON_FORMAT,
    FLUSH_SECONDS,
    WRITE_BYTES,
    AccessLines,
    BufferedStreamHandler,
    Formatter,
    QuickRecords,
    Redact,
    Redactor,
)
from proxy.observe import ACCESS_FORMAT

FMT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ARGS = ("127.0.0.1", "GET", "/bucket/shard-000001.tar", 200, "HIT", 65536, 0.0001, "")


class Writes(io.StringIO):
    """A stream that keeps each write apart (what one write system call would carry)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def _logger(name: str, handler: logging.Handler) -> logging.Logger:
    """A logger of its own (not registered: the proxy's loggers stay untouched)."""
    logger = logging.Logger(name, logging.DEBUG)
    logger.addHandler(handler)
    return logger


def _handler(stream: io.StringIO, name: str, **kw: float) -> BufferedStreamHandler:
    handler = BufferedStreamHandler(stream, buffered=(name,), **kw)  # type: ignore[arg-type]
    handler.setFormatter(Formatter(FMT))
    return handler


def _access(logger: logging.Logger, n: int, level: int = logging.INFO) -> None:
    logger.log(level, ACCESS_FORMAT, *ARGS[:2], f"/shard-{n:06d}.tar", *ARGS[3:])


# ------------------------------------------------------------------ the handler, in process


@pytest.mark.fast
def test_kept_lines_are_written_within_the_interval_when_idle():
    stream = Writes()
    handler = _handler(stream, "t.access", interval=0.3)
    access = _logger("t.access", handler)
    try:
        start = time.monotonic()
        for n in range(3):
            _access(access, n)
        assert stream.getvalue() == ""  # kept
        wait_until(lambda: stream.getvalue().count("\n") == 3, 5, 0.01, "the kept lines")
        assert time.monotonic() - start >= 0.25
        assert len(stream.writes) == 1  # together, in one write
        time.sleep(0.05)
        _access(access, 3)  # the flusher keeps going for lines that come later
        wait_until(lambda: stream.getvalue().count("\n") == 4, 5, 0.01, "a later line")
        assert [int(m) for m in re.findall(r"shard-(\d+)", stream.getvalue())] == [0, 1, 2, 3]
    finally:
        handler.close()


@pytest.mark.fast
def test_any_other_line_is_written_at_once_after_the_kept_ones():
    """A WARNING (of the access logger or any other) and any other logger's line go out
    at once, after the access lines logged before them: the order is kept."""
    stream = Writes()
    handler = _handler(stream, "t.access", interval=60)
    access, other = _logger("t.access", handler), _logger("t.other", handler)
    try:
        _access(access, 1)
        _access(access, 2)
        access.warning("a warning of the access logger")
        lines = stream.getvalue().splitlines()
        assert [re.sub(r"^\S+ \S+ ", "", ln) for ln in lines] == [
            'INFO t.access: 127.0.0.1 "GET /shard-000001.tar" 200 HIT 65536 0.000s',
            'INFO t.access: 127.0.0.1 "GET /shard-000002.tar" 200 HIT 65536 0.000s',
            "WARNING t.access: a warning of the access logger",
        ]
        _access(access, 3)
        other.info("stopping")  # an INFO line of another logger: at once as well
        assert (
            stream.getvalue()
            .splitlines()[-2:][0]
            .endswith('shard-000003.tar" 200 HIT 65536 0.000s')
        )
        assert stream.getvalue().endswith("INFO t.other: stopping\n")
        _access(access, 4)
        access.error("boom")
        assert stream.getvalue().splitlines()[-1].endswith("ERROR t.access: boom")
        assert "shard-000004" in stream.getvalue().splitlines()[-2]
    finally:
        handler.close()


@pytest.mark.fast
def test_lines_are_written_once_the_buffer_fills_in_whole_lines_of_at_most_pipe_buf():
    stream = Writes()
    handler = _handler(stream, "t.access", interval=60, size=20_000)
    access = _logger("t.access", handler)
    try:
        n = 0
        while not stream.writes:
            _access(access, n)
            n += 1
            assert n < 1000, "never written"
        written = stream.getvalue()
        assert written.count("\n") == n  # every line kept so far, none cut
        assert 20_000 <= len(written) < 20_000 + 200
        assert len(stream.writes) > 1
        for w in stream.writes:  # whole lines, none longer than a pipe writes whole
            assert w.endswith("\n") and len(w.encode()) <= WRITE_BYTES
        _access(access, n)
        access.info("x" * 5000)  # a line longer than that is written alone
        handler.flush()
        assert stream.writes[-1] == stream.getvalue()[-len(stream.writes[-1]) :]
        assert stream.writes[-1].endswith("x" * 5000 + "\n")
        assert "shard-" not in stream.writes[-1]
    finally:
        handler.close()


@pytest.mark.fast
def test_flush_and_close_write_everything_kept():
    stream = Writes()
    handler = _handler(stream, "t.access", interval=60)
    access = _logger("t.access", handler)
    _access(access, 1)
    handler.flush()
    assert stream.getvalue().count("\n") == 1
    _access(access, 2)
    handler.close()  # logging.shutdown at exit: flush, then close
    assert stream.getvalue().count("\n") == 2


@pytest.mark.fast
def test_interval_zero_writes_every_line_at_once():
    stream = Writes()
    handler = _handler(stream, "t.access", interval=0)
    access = _logger("t.access", handler)
    _access(access, 1)
    _access(access, 2)
    assert len(stream.writes) == 2 and stream.getvalue().count("\n") == 2
    handler.close()


@pytest.mark.fast
def test_kept_lines_are_redacted():
    """The filter runs before a line is kept: what is written later has no credential."""
    stream = Writes()
    handler = _handler(stream, "t.access", interval=60)
    handler.addFilter(Redact(Redactor(["known-secret-value"])))
    access = _logger("t.access", handler)
    access.info(
        ACCESS_FORMAT,
        "127.0.0.1",
        "GET",
        "/b/k.tar?X-Amz-Credential=AKIA/x&X-Amz-Signature=0123abcd&n=known-secret-value",
        200, "HIT", 1, 0.001, "",
    )  # fmt: skip
    assert stream.getvalue() == ""
    handler.close()
    line = stream.getvalue()
    assert "0123abcd" not in line and "AKIA" not in line and "known-secret-value" not in line
    assert "X-Amz-Signature=[REDACTED]" in line and "n=[REDACTED]" in line


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_writes_its_own_lines_and_none_of_its_parents(tmp_path):
    """Before a fork the kept lines are written (the child would write them again);
    the child keeps its own and its own flusher writes them (threads do not survive a
    fork), as each worker of ``--workers`` does."""
    path = tmp_path / "log"
    stream = open(path, "a")  # noqa: SIM115 - closed below
    handler = _handler(stream, "t.access", interval=0.2)  # type: ignore[arg-type]
    access = _logger("t.access", handler)
    try:
        _access(access, 1)  # kept, and the parent's flusher started
        pid = os.fork()
        if pid == 0:  # the child: its line written by its own flusher, then gone at once
            try:
                _access(access, 2)
                deadline = time.monotonic() + 5
                while "shard-000002" not in path.read_text() and time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                os._exit(0)  # nothing flushed on the way out
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _access(access, 3)
        handler.flush()
        got = [int(m) for m in re.findall(r"shard-(\d+)", path.read_text())]
        assert got == [1, 2, 3]
    finally:
        handler.close()
        stream.close()


# ------------------------------------------------------------------ the records


def _attrs(record: logging.LogRecord) -> dict:
    skip = {"created", "msecs", "relativeCreated"}
    return {k: v for k, v in vars(record).items() if k not in skip}


@pytest.mark.fast
def test_quick_records_are_what_logging_makes():
    logger = logging.getLogger("t.quick")
    quick = QuickRecords(logger, ACCESS_FORMAT, "/x/observe.py")
    for level in (logging.INFO, logging.DEBUG, logging.INFO):
        for _ in range(2):  # the first made by logging, the next from it
            before = time.time()
            record = quick.make(level, ARGS)
            after = time.time()
            standard = logger.makeRecord(
                logger.name, level, "/x/observe.py", 0, ACCESS_FORMAT, ARGS, None
            )
            assert type(record) is logging.LogRecord
            assert _attrs(record) == _attrs(standard)
            assert before - 0.001 <= record.created <= after + 0.001
            assert record.msecs == int((record.created - int(record.created)) * 1000) or (
                record.msecs == 0.0  # Python 3.13's rounding of 999.9999 ms
            )
            assert record.relativeCreated >= 0
            assert (
                Formatter(FMT).format(record)[23:] == logging.Formatter(FMT).format(standard)[23:]
            )
    seen = {}

    def other_thread() -> None:
        seen["record"] = quick.make(logging.INFO, ARGS)
        seen["record2"] = quick.make(logging.INFO, ARGS)

    t = threading.Thread(target=other_thread, name="another thread")
    t.start()
    t.join(5)
    assert seen["record2"].threadName == "another thread"
    assert seen["record2"].thread == t.ident


@pytest.mark.fast
def test_quick_records_follow_a_record_factory():
    made = []
    standard = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = standard(*args, **kwargs)
        record.custom = "yes"
        made.append(record)
        return record

    quick = QuickRecords(logging.getLogger("t.factory"), ACCESS_FORMAT, __file__)
    quick.make(logging.INFO, ARGS)
    logging.setLogRecordFactory(factory)
    try:
        record = quick.make(logging.INFO, ARGS)
    finally:
        logging.setLogRecordFactory(standard)
    assert made == [record] and record.custom == "yes"


# ------------------------------------------------------------------ the lines, straight


PRESIGNED = "/b/k.tar?X-Amz-Credential=AKIA/x&X-Amz-Signature=0123abcd&n=known-secret-value"


def _daemon_handler(stream: io.StringIO, name: str) -> BufferedStreamHandler:
    """As proxy.config.configure_logging and proxy.logs.install set it up."""
    handler = BufferedStreamHandler(stream, buffered=(name,), interval=60)  # type: ignore[arg-type]
    handler.setFormatter(Formatter(DAEMON_FORMAT))
    handler.addFilter(Redact(Redactor(["known-secret-value"])))
    return handler


def _no_record(*args: object) -> logging.LogRecord:
    raise AssertionError("a record was made")


@pytest.mark.fast
def test_straight_lines_are_the_lines_of_the_records():
    """With the daemon's handler alone a line is written without a record, and it is
    the line the record would have given: same text, redacted, same time format."""
    straight, standard = Writes(), Writes()
    a = _logger("t.access", _daemon_handler(straight, "t.access"))
    b = _logger("t.access", _daemon_handler(standard, "t.access"))
    lines = AccessLines(a, ACCESS_FORMAT, __file__)
    lines.records.make = _no_record  # type: ignore[method-assign]
    records = QuickRecords(b, ACCESS_FORMAT, __file__)
    for level in (logging.INFO, logging.DEBUG):
        for target in ("/s.tar", PRESIGNED, "/ünïcode.tar", "/x" * 3000):
            args = ("::1", "GET", target, 206, "MISS", 123, 1.23456, " cut-off")
            lines.log(level, args)
            b.handle(records.make(level, args))
    for h in (*a.handlers, *b.handlers):
        h.flush()
    ours, theirs = straight.getvalue().splitlines(), standard.getvalue().splitlines()
    assert len(ours) == len(theirs) == 8
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
    for x, y in zip(ours, theirs, strict=True):
        assert re.match(stamp, x) and re.match(stamp, y)
        assert x[24:] == y[24:]
    assert "0123abcd" not in straight.getvalue() and "known-secret-value" not in ours[1]
    assert "X-Amz-Signature=[REDACTED]" in ours[1]
    assert ours[0][24:] == 'INFO t.access: ::1 "GET /s.tar" 206 MISS 123 1.235s cut-off'
    assert ours[4][24:].startswith("DEBUG t.access: ")


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.fast
def test_anything_but_the_daemons_handler_alone_gets_the_record():
    """Another handler on the way (a test's caplog), a filter on the logger, a handler
    level above the line's, another format or filter, another record factory: the
    record is made and handled as before."""
    args = ("127.0.0.1", "GET", PRESIGNED, 200, "HIT", 1, 0.001, "")

    def setup() -> tuple[logging.Logger, Writes, BufferedStreamHandler]:
        stream = Writes()
        handler = _daemon_handler(stream, "t.access")
        parent = logging.Logger("t", logging.DEBUG)
        parent.addHandler(handler)
        access = logging.Logger("t.access", logging.DEBUG)
        access.parent = parent
        return access, stream, handler

    access, stream, handler = setup()
    collect = Collect()
    access.addHandler(collect)
    AccessLines(access, ACCESS_FORMAT, __file__).log(logging.INFO, args)
    handler.flush()
    assert len(collect.records) == 1 and collect.records[0].name == "t.access"
    assert stream.getvalue().count("\n") == 1 and "X-Amz-Signature=[REDACTED]" in stream.getvalue()

    access, stream, handler = setup()
    access.addFilter(lambda record: False)
    AccessLines(access, ACCESS_FORMAT, __file__).log(logging.INFO, args)
    handler.flush()
    assert stream.getvalue() == ""  # the logger's filter said no

    access, stream, handler = setup()
    handler.setLevel(logging.WARNING)
    AccessLines(access, ACCESS_FORMAT, __file__).log(logging.INFO, args)
    handler.flush()
    assert stream.getvalue() == ""

    access, stream, handler = setup()
    handler.setFormatter(Formatter("%(levelname)s %(process)d %(message)s"))
    AccessLines(access, ACCESS_FORMAT, __file__).log(logging.INFO, args)
    handler.flush()
    assert stream.getvalue().startswith(f"INFO {os.getpid()} 127.0.0.1")
    assert "X-Amz-Signature=[REDACTED]" in stream.getvalue()

    access, stream, handler = setup()
    handler.addFilter(lambda record: "AKIA" not in record.getMessage())  # a second filter
    AccessLines(access, ACCESS_FORMAT, __file__).log(logging.INFO, args)
    handler.flush()
    assert stream.getvalue().count("\n") == 1  # redacted first, then let through

    access, stream, handler = setup()
    made = []
    standard = logging.getLogRecordFactory()

    def factory(*a, **kw):
        made.append(standard(*a, **kw))
        return made[-1]

    logging.setLogRecordFactory(factory)
    try:
        AccessLines(access, ACCESS_FORMAT, __file__).log(logging.INFO, args)
    finally:
        logging.setLogRecordFactory(standard)
    handler.flush()
    assert len(made) == 1 and stream.getvalue().count("\n") == 1


@pytest.mark.fast
def test_a_warning_comes_after_the_straight_lines_before_it():
    stream = Writes()
    handler = _daemon_handler(stream, "t.access")
    access = _logger("t.access", handler)
    lines = AccessLines(access, ACCESS_FORMAT, __file__)
    for n in range(3):
        lines.log(logging.INFO, ("127.0.0.1", "GET", f"/s{n}.tar", 200, "HIT", 1, 0.001, ""))
    assert stream.getvalue() == ""
    _logger("t.other", handler).warning("upstream failing")
    got = stream.getvalue().splitlines()
    assert [ln[24:] for ln in got] == [
        *(f'INFO t.access: 127.0.0.1 "GET /s{n}.tar" 200 HIT 1 0.001s' for n in range(3)),
        "WARNING t.other: upstream failing",
    ]
    handler.close()


# ------------------------------------------------------------------ the daemon


@pytest.fixture(scope="module")
def origin():
    o = Origin(files={f"s{i}.tar": bytes([i]) * 2048 for i in range(40)}).start()
    yield o
    o.stop()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _lines(p: ProxyProcess) -> list[str]:
    return [ln for ln in p.log_text().splitlines() if " shardcache.access: " in ln]


def test_an_idle_proxy_writes_its_access_lines_within_the_interval(origin, tmp_path):
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url).start()
    try:
        for path in ("/s0.tar", "/s0.tar", "/s1.tar"):
            assert _get(p.url + path) == bytes([int(path[2])]) * 2048
        done = time.monotonic()
        wait_until(lambda: len(_lines(p)) == 3, FLUSH_SECONDS + 5, 0.02, "the access lines")
        assert time.monotonic() - done < FLUSH_SECONDS + 5
        assert [ln.split(": ", 1)[1].rsplit(" ", 1)[0] for ln in _lines(p)] == [
            '127.0.0.1 "GET /s0.tar" 200 MISS 2048',
            '127.0.0.1 "GET /s0.tar" 200 HIT 2048',
            '127.0.0.1 "GET /s1.tar" 200 MISS 2048',
        ]
    finally:
        assert p.stop() == 0


def test_every_line_is_written_at_sigterm_and_redacted(origin, tmp_path):
    """Lines still kept when SIGTERM comes are written on the way out, redacted."""
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url).start()
    try:
        assert _get(p.url + "/s2.tar")
        wait_until(lambda: len(_lines(p)) == 1, FLUSH_SECONDS + 5, 0.02, "the first line")
        for i in range(30):
            assert _get(f"{p.url}/s2.tar?X-Amz-Signature=s3cr3tsig{i:02d}&n={i}")
    finally:
        assert p.stop(signal.SIGTERM) == 0
    lines = _lines(p)
    assert len(lines) == 31, p.log_text()[-3000:]
    assert "s3cr3tsig" not in p.log_text()
    assert [re.search(r"&n=(\d+)", ln).group(1) for ln in lines[1:]] == [str(i) for i in range(30)]
    assert all("X-Amz-Signature=[REDACTED]" in ln for ln in lines[1:])
    assert p.log_text().rstrip().endswith("stopped")  # the access lines came before it


@pytest.mark.slow
def test_each_worker_writes_its_lines_when_idle_and_at_sigterm(origin, tmp_path):
    """With ``--workers 2`` each worker (a forked process) keeps and writes its own
    lines: all written while idle, none twice, all there after SIGTERM."""
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, "--workers", "2").start()
    try:
        paths = [f"/s{i}.tar" for i in range(3, 23)]
        for path in paths:  # a connection each: the kernel spreads them over the workers
            assert _get(p.url + path)
        wait_until(lambda: len(_lines(p)) == len(paths), FLUSH_SECONDS + 10, 0.05, "every line")
        for path in paths:
            assert _get(p.url + path)
    finally:
        assert p.stop(signal.SIGTERM) == 0
    lines = _lines(p)
    assert len(lines) == 2 * len(paths), p.log_text()[-3000:]
    for path in paths:
        assert sum(f'"GET {path}" 200 ' in ln for ln in lines) == 2, path
    # each worker said it was ready, and both answered requests
    assert len(re.findall(r"worker \d \(pid \d+\) ready", p.log_text())) == 2


@pytest.mark.parametrize("mode", ["on", "off"])
def test_the_access_log_on_or_off(origin, tmp_path, mode):
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, "--access-log", mode)
    p.start()
    try:
        assert _get(p.url + "/s30.tar")
        if mode == "on":  # written at once: there before the next request is answered
            wait_until(lambda: _lines(p), 5, 0.02, "the access line")
    finally:
        assert p.stop() == 0
    assert len(_lines(p)) == (1 if mode == "on" else 0), p.log_text()
    assert "serving on" in p.log_text() and "stopped" in p.log_text()


@pytest.mark.fast
def test_access_log_setting(tmp_path):
    from proxy.config import parse_settings

    base = ["--cache-dir", str(tmp_path), "--upstream", "http://o.example"]
    assert parse_settings(base).access_log == "buffered"
    assert parse_settings([*base, "--access-log", "off"]).access_log == "off"
    assert parse_settings(base, {"SHARDCACHE_ACCESS_LOG": "on"}).access_log == "on"


@pytest.mark.fast
def test_a_closed_handler_leaves_no_flusher_behind():
    def flushers() -> int:
        return sum(t.name == "log flusher" for t in threading.enumerate())

    before = flushers()
    stream = Writes()
    handler = _handler(stream, "t.access", interval=0.05)
    _access(_logger("t.access", handler), 1)
    assert flushers() == before + 1
    handler.close()
    wait_until(lambda: flushers() == before, 5, 0.01, "the flusher's end")
    assert stream.getvalue().count("\n") == 1


@pytest.mark.fast
@pytest.mark.parametrize(
    "fmt, style, kw",
    [
        (FMT, "%", {}),
        ("%(levelname)s %(message)s [%(process)d %(threadName)s %(module)s]", "%", {}),
        (FMT, "%", {"datefmt": "%H:%M:%S"}),
        ("%(message)s %(extra_field)s", "%", {"defaults": {"extra_field": "x"}}),
        ("{asctime} {levelname} {message}", "{", {}),
    ],
)
def test_the_formatter_writes_what_logging_writes(fmt, style, kw):
    """One step for a plain record, the base class's steps for the rest: the same text."""
    ours, standard = Formatter(fmt, style=style, **kw), logging.Formatter(fmt, style=style, **kw)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        info = sys.exc_info()
    for exc_info, stack in ((None, None), (info, None), (None, "Stack (most recent call last)")):
        record = logging.LogRecord("t", logging.INFO, __file__, 1, ACCESS_FORMAT, ARGS, exc_info)
        record.stack_info = stack
        twin = logging.makeLogRecord(dict(vars(record)))
        assert ours.format(record) == standard.format(twin)
    with pytest.raises(ValueError, match="Formatting field not found"):
        Formatter("%(nonesuch)s").format(record)
