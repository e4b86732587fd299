"""One setting of the proxy (:class:`Setting`: its name, flag, variable, parser, bounds,
default, help, metavar and group), the sections settings are listed in, and how a default
reads in the help. The table of all settings is :mod:`proxy.settings_table`; reading them
from flags, the environment and a TOML file is :mod:`proxy.config`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardcache.errors import ConfigError

ENV_PREFIX = "SHARDCACHE_"
SIZE_UNITS = (
    "Sizes are bytes, or a number with a unit: K, M, G, T, P are powers of 1000 "
    "(G = 10^9 bytes), KiB, MiB, GiB, TiB, PiB powers of 1024 (GiB = 2^30 bytes); "
    "the B and the case are optional, so 500G, 1.5T and 10MiB all work. A bound without "
    "a unit below 1 MiB (--cache-size 10) is refused as a forgotten unit; write 10B for bytes."
)
# The sections of ``serve --help``, docs/configuration.md and docs/shardcache.toml, in
# order: a Setting's ``group`` is one of these keys ("" lists it with --config and -h).
GROUPS: tuple[tuple[str, str], ...] = (
    ("cache", "the on-disk store: where, how big, what it keeps and for how long"),
    ("upstreams", "where shards come from, and how the proxy talks to them"),
    ("fronts", "what clients connect to: address, TLS, the S3 front"),
    ("admin", "admin routes, read plans and shutdown"),
    ("performance", "processes, background downloads, ranged parts, transports"),
    ("logging", "what the proxy logs"),
)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Setting:
    """One setting: the single place its name, flag, variable, parser and default live.

    ``parse`` turns the text of a value (for a ``many`` setting: the list of texts) into
    the value, raising ValueError with a message; ``choices`` (compared in lower case),
    ``minimum`` and ``maximum`` are checked after it. ``flag=None`` marks a setting that
    only code sets (tests, embedding): no flag, no variable, no file key.
    """

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any] = str
    flag: str | None = ""  # "": "--" + name with dashes
    env: str = ""  # "": ENV_PREFIX + NAME
    metavar: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    many: bool = False  # a list: repeatable flag; comma or space separated elsewhere
    split_flag: bool = True  # a many setting: split each flag value on commas too
    required: bool = False
    none_means: str = ""  # what a default of None does, for the help
    show: Callable[[Any], str] | None = None  # how the default reads in the help
    group: str = ""  # a key of GROUPS: where --help and the docs list it

    def __post_init__(self) -> None:
        if self.flag == "":
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))
        if self.env == "" and self.flag is not None:
            object.__setattr__(self, "env", ENV_PREFIX + self.name.upper())
        if self.metavar is None and self.choices:
            object.__setattr__(self, "metavar", "|".join(self.choices))

    def default_text(self) -> str:
        """The default as the help and the docs show it; "" when there is none."""
        if self.required:
            return "required"
        if self.default is None:
            return self.none_means
        if self.show is not None:
            return self.show(self.default)
        return _show(self.default)

    def meaning(self) -> str:
        """The help text with the accepted choices, as plain text."""
        if self.choices:
            return f"{self.help} (one of {', '.join(self.choices)})"
        return self.help

    def help_line(self) -> str:
        """The ``--help`` text: the meaning, the default and the variable."""
        notes = [f"one of {', '.join(self.choices)}"] if self.choices else []
        default = self.default_text()
        if default:
            notes.append(default if self.required else f"default {default}")
        text = self.help + (f" ({'; '.join(notes)})" if notes else "")
        return text + f" [env {self.env}" + (", comma or space separated]" if self.many else "]")

    def convert(self, raw: Any, source: str = "") -> Any:
        """The value of ``raw`` (text, or a list of texts), checked; ConfigError naming
        the flag (and ``source``, where the value came from, when not the command line)."""
        where = f" (from {source})" if source else ""
        flag = self.flag or self.name
        if self.choices:
            value = str(raw).strip().lower()
            if value not in self.choices:
                raise ConfigError(
                    flag, f"must be one of {', '.join(self.choices)} (got {raw!r}){where}"
                )
            return value
        try:
            value = self.parse(raw)
        except ValueError as exc:
            raise ConfigError(flag, f"{exc}{where}") from None
        if self.minimum is not None and not value >= self.minimum:
            raise ConfigError(flag, f"must be at least {self.minimum:g} (got {raw!r}){where}")
        if self.maximum is not None and not value <= self.maximum:
            raise ConfigError(flag, f"must be at most {self.maximum:g} (got {raw!r}){where}")
        return value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ", ".join(map(str, value))
    return str(value)


def _show_size(n: int) -> str:
    """``100G`` for 100 * 10^9, ``8MiB`` for 8 * 2^20: how a size default reads."""
    for i in range(6, 0, -1):
        if n and n % 1000**i == 0:
            return f"{n // 1000**i}{'KMGTPE'[i - 1]}"
        if n and n % 1024**i == 0:
            return f"{n // 1024**i}{'KMGTPE'[i - 1]}iB"
    return str(n)
