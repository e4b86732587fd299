"""Moved to :mod:`support.pipeline_helpers`; the old name stays importable (the same module object)."""

import sys

from support import pipeline_helpers

sys.modules[__name__] = pipeline_helpers
