"""Moved to :mod:`support.huborigin`; the old name stays importable (the same module object)."""

import sys

from support import huborigin

sys.modules[__name__] = huborigin
