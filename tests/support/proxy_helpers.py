"""The proxy tests' servers under their first module name: the origin is
:mod:`support.origins`, the proxy subprocess :mod:`support.proxy`, the shard builder
:mod:`support.data`."""

from __future__ import annotations

from .data import make_shard
from .origins import Fault, Origin
from .proxy import ProxyProcess, aws_env, free_port, raw_request

__all__ = ["Fault", "Origin", "ProxyProcess", "aws_env", "free_port", "make_shard", "raw_request"]
