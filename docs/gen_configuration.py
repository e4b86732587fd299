"""Write docs/configuration.md from the settings table (proxy/config.py) and the tools'
parsers.

python docs/gen_configuration.py          # rewrite the file
python docs/gen_configuration.py --check  # exit 1 if the file is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardcache.cli.configref import configuration_reference

TARGET = Path(__file__).resolve().parent / "configuration.md"


def main(argv: list[str]) -> int:
    text = configuration_reference()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is out of date: run python docs/gen_configuration.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
