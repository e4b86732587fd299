"""Moved to :mod:`support.httporigin`; the old name stays importable (the same module object)."""

import sys

from support import httporigin

sys.modules[__name__] = httporigin
