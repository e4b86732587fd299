"""One error model: every error is built complete (status hint, S3 code, header fields)
and never changed after, the S3 front's errors are part of the one tree, and one
function says what a client is told of any of them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from aiohttp import web

import proxy.errormap as errormap
from proxy.errormap import S3Error, error_answer
from proxy.upstream.errors import PassedAnswer, UpstreamRedirect, s3_error, status_error
from shardcache.errors import (
    MethodNotAllowed,
    NotFound,
    ProxyError,
    RangeNotSatisfiable,
    ShardcacheError,
    UpstreamThrottled,
)

ROOT = Path(__file__).resolve().parent.parent
S3_ERRORS = [
    cls
    for _, cls in inspect.getmembers(errormap, inspect.isclass)
    if issubclass(cls, S3Error) and cls is not S3Error
]


def test_the_s3_fronts_errors_are_in_the_one_tree():
    assert len(S3_ERRORS) >= 14
    for cls in S3_ERRORS:
        err = cls("what went wrong")
        assert isinstance(err, ShardcacheError) and isinstance(err, ProxyError)
        told = error_answer(err)
        assert (told.status, told.code) == (cls.status_hint, cls.s3_code)
        assert (err.status, err.code) == (told.status, told.code)
        assert told.message == err.message == "what went wrong"
        assert str(err) == f"{cls.s3_code}: what went wrong"


def test_an_s3_error_keeps_its_code_under_a_status_of_its_own():
    err = errormap.AuthorizationQueryParametersError("bad X-Amz-Expires", status_hint=403)
    told = error_answer(err)
    assert (told.status, told.code) == (403, "AuthorizationQueryParametersError")


def test_fields_of_the_answer_come_from_the_error_as_built():
    told = error_answer(RangeNotSatisfiable("past the end", size=1234))
    assert (told.status, told.code) == (416, "InvalidRange")
    assert told.headers == {"Content-Range": "bytes */1234"}
    assert told.details == {"ActualObjectSize": "1234"}
    assert error_answer(RangeNotSatisfiable("bad range")).headers == {}
    assert error_answer(MethodNotAllowed("no")).headers == {"Allow": "GET, HEAD"}
    assert error_answer(MethodNotAllowed("no", allow="POST")).headers == {"Allow": "POST"}
    redirect = UpstreamRedirect("http://o/a.tar", 302, "/b.tar")
    told = error_answer(redirect)
    assert told.status == 302
    assert told.headers == {"Location": "http://o/b.tar", "X-Cache": "BYPASS"}
    err = ProxyError("token", status_hint=401, headers={"WWW-Authenticate": "Bearer"})
    assert error_answer(err).headers == {"WWW-Authenticate": "Bearer"}
    with pytest.raises(TypeError):
        err.headers["X"] = "y"  # type: ignore[index]


def test_a_stores_code_is_given_at_construction():
    err = s3_error("s3://b/k", "NoSuchBucket", 404, "gone")
    assert type(err) is NotFound and err.s3_code == "NoSuchBucket"
    assert error_answer(err).code == "NoSuchBucket"
    # a status unlike the class's: the class's code would mislead, the status's is told
    err = s3_error("s3://b/k", "NoSuchBucket", 400, "odd")
    assert err.s3_code is None and error_answer(err).code == "NoSuchKey"
    throttled = s3_error("s3://b/k", "SlowDown", 503)
    assert type(throttled) is UpstreamThrottled and throttled.s3_code is None
    assert error_answer(throttled).code == "SlowDown"


def test_an_upstreams_error_answer_is_told_with_its_status_and_code():
    doc = b"<Error><Code>NoSuchBucket</Code><Message>no such bucket</Message></Error>"
    err = status_error("http://o/a", 404, "Not Found", PassedAnswer(404, "", (), doc))
    told = error_answer(err)
    assert (told.status, told.code, told.message) == (404, "NoSuchBucket", "no such bucket")
    err = status_error("http://o/a", 401, "", PassedAnswer(401, "", (), b"denied"))
    told = error_answer(err)
    assert (told.status, told.code) == (403, "AccessDenied") and "http://o/a" in told.message


def test_aiohttps_errors_are_told_by_the_same_function():
    told = error_answer(web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2))
    assert (told.status, told.code) == (413, "InternalError")


def _exception_names() -> set[str]:
    import builtins

    import proxy.upstream.errors
    import shardcache.errors

    names = set()
    for module in (builtins, shardcache.errors, errormap, proxy.upstream.errors):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, BaseException):
                names.add(name)
    return names


EXCEPTIONS = _exception_names()


def _annotations_after_the_fact(path: Path) -> list[str]:
    """Attributes set, or ``setattr``, on a caught exception or on one built and not yet
    raised (``exc = NotFound(...)``; ``exc.headers = ...``)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for scope in ast.walk(tree):
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        errors = {
            t.id
            for node in ast.walk(scope)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id in EXCEPTIONS
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        errors |= {
            node.name
            for node in ast.walk(scope)
            if isinstance(node, ast.ExceptHandler) and node.name
        }
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id in errors
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in errors
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return sorted(set(found))


def test_no_exception_is_changed_after_it_is_raised():
    offenders = [
        where
        for package in ("proxy", "shardcache", "dbcache")
        for path in sorted((ROOT / package).rglob("*.py"))
        for where in _annotations_after_the_fact(path)
    ]
    assert not offenders, offenders
