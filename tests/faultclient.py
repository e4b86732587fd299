"""Moved to :mod:`support.faultclient`; the old name stays importable (the same module object)."""

import sys

from support import faultclient

sys.modules[__name__] = faultclient
