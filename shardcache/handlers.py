"""Pluggable exception handlers for the sample pipeline.

A handler is called with the exception raised while opening a shard, reading a tar
member or grouping files into samples. It answers with what the pipeline does next:

- raise (an exception, usually the one it was given): the pipeline stops with that error;
- ``True``: skip what failed and continue (with the next shard, if the shard is unusable);
- ``False``: stop the pipeline quietly.

These follow webdataset's handlers of the same names, except that the ``warn_*``
handlers never sleep: they report through :mod:`warnings` and return at once.
"""

from __future__ import annotations

import warnings

__all__ = [
    "reraise_exception",
    "ignore_and_continue",
    "ignore_and_stop",
    "warn_and_continue",
    "warn_and_stop",
]


def reraise_exception(exn: BaseException) -> bool:
    """Raise ``exn`` again: the pipeline stops with this error."""
    raise exn


def ignore_and_continue(exn: BaseException) -> bool:
    """Ignore ``exn`` and continue with what comes next. Always returns True."""
    return True


def ignore_and_stop(exn: BaseException) -> bool:
    """Ignore ``exn`` and stop the pipeline quietly. Always returns False."""
    return False


def _warn(exn: BaseException) -> None:
    # stacklevel=3 points the warning at the pipeline stage that called the handler
    warnings.warn(f"{type(exn).__name__}: {exn}", RuntimeWarning, stacklevel=3)


def warn_and_continue(exn: BaseException) -> bool:
    """Issue a :class:`RuntimeWarning` naming ``exn``, then continue. Returns True."""
    _warn(exn)
    return True


def warn_and_stop(exn: BaseException) -> bool:
    """Issue a :class:`RuntimeWarning` naming ``exn``, then stop quietly. Returns False."""
    _warn(exn)
    return False
