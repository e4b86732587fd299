"""Print the lowest version pyproject.toml allows of a dependency (its ``>=`` bound):
``python tests/lowest.py aiohttp`` -> ``3.14``. Used by ``make test-compat``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def lowest(name: str, text: str) -> str:
    """The ``>=`` bound of ``name`` in the dependency lines of ``text``."""
    m = re.search(rf'^\s*"{re.escape(name)}\s*>=\s*([0-9][0-9A-Za-z.]*)', text, re.MULTILINE)
    if m is None:
        raise SystemExit(f"{name}: no lower bound (>=) in {PYPROJECT}")
    return m.group(1)


if __name__ == "__main__":
    print(lowest(sys.argv[1], PYPROJECT.read_text()))
