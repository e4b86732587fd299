"""Moved to :mod:`support.store_faults`; the old name stays importable (the same module object)."""

import sys

from support import store_faults

sys.modules[__name__] = store_faults
