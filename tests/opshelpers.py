"""Moved to :mod:`support.opshelpers`; the old name stays importable (the same module object)."""

import sys

from support import opshelpers

sys.modules[__name__] = opshelpers
