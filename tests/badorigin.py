"""Moved to :mod:`support.badorigin`; the old name stays importable (the same module object)."""

import sys

from support import badorigin

sys.modules[__name__] = badorigin
