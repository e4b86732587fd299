"""Moved to :mod:`support.proxy_helpers`; the old name stays importable (the same module object)."""

import sys

from support import proxy_helpers

sys.modules[__name__] = proxy_helpers
