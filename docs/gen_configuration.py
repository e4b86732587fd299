"""Write docs/configuration.md from the settings table (proxy/config.py) and the tools'
parsers, and docs/shardcache.toml (every setting, commented out) from the table.

python docs/gen_configuration.py          # rewrite the files
python docs/gen_configuration.py --check  # exit 1 if a file is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardcache.cli.configref import configuration_reference, example_config

TARGET = Path(__file__).resolve().parent / "configuration.md"
EXAMPLE = Path(__file__).resolve().parent / "shardcache.toml"


def main(argv: list[str]) -> int:
    files = ((TARGET, configuration_reference()), (EXAMPLE, example_config()))
    if "--check" in argv:
        stale = [path for path, text in files if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run python docs/gen_configuration.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files:
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
