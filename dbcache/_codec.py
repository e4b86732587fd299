"""Sample codecs: how a sample dict becomes a database row and back.

The default ``safe`` codec is a small tagged binary format. Decoding it only ever builds
bytes, str, int, float, bool, None, lists, tuples, dicts and (when numpy is installed)
numpy arrays and scalars read with ``allow_pickle=False``: a tampered row can make decoding
fail, never run code.

The ``pickle`` codec stores anything picklable. Unpickling runs code chosen by whoever
wrote the file: use it only for files you created yourself and trust.

The safe format is described in :mod:`dbcache._format`; its encoders are in
:mod:`dbcache._encode`, its decoders in :mod:`dbcache._decode`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dbcache._decode import safe_decode, safe_decode_rows
from dbcache._encode import safe_encode, safe_encode_row
from dbcache._format import ROW_HEADER, SAFE_HEADER, CodecError, Row, RowDecodeError

__all__ = [
    "CodecError",
    "RowDecodeError",
    "Codec",
    "CODECS",
    "get_codec",
    "safe_encode",
    "safe_decode",
    "pickle_encode",
    "pickle_decode",
    "SAFE_HEADER",
    "ROW_HEADER",
    "safe_encode_row",
    "safe_decode_rows",
]


@dataclass(frozen=True)
class Codec:
    """How a sample becomes bytes and back.

    ``encode``/``decode`` turn one value into one record. ``encode_row`` turns a sample
    into the (``fields``, ``data``, ``payload``) columns of a database row, and
    ``decode_rows(rows, layouts)`` turns an iterable of (``url``, ``key``, ``layout``,
    ``data``, ``payload``) rows back into samples, where ``layouts`` maps a layout id to
    its ``fields`` value (``None``: the layout column holds ``fields`` itself); it raises
    :class:`RowDecodeError` for a bad row.
    """

    name: str
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    encode_row: Callable[[Any], Row]
    decode_rows: Callable[[Iterable[tuple]], Iterator[Any]]
    trusted_only: bool = False


def pickle_encode(sample: Any) -> bytes:
    """Encode anything picklable. Only for files that nobody else can write."""
    return pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)


def pickle_decode(data: bytes) -> Any:
    """Unpickle a record. DANGEROUS for untrusted files: unpickling can run any code."""
    try:
        return pickle.loads(data)  # noqa: S301 - explicit opt-in, documented as unsafe
    except Exception as exc:
        raise CodecError(f"bad pickle record: {exc}") from exc


def pickle_encode_row(sample: Any) -> Row:
    """A pickle row: ``fields`` names the codec, ``data`` is the pickle. Trusted files only."""
    return b"pickle", pickle_encode(sample), None


def pickle_decode_rows(
    rows: Iterable[tuple], layouts: Mapping[Any, bytes] | None = None
) -> Iterator[Any]:
    """Unpickle rows. DANGEROUS for untrusted files: unpickling can run any code."""
    for url, key, _layout, data, _payload in rows:
        try:
            yield pickle_decode(data)
        except CodecError as exc:
            raise RowDecodeError(str(exc), url, key) from None


CODECS: dict[str, Codec] = {
    "safe": Codec("safe", safe_encode, safe_decode, safe_encode_row, safe_decode_rows),
    "pickle": Codec(
        "pickle",
        pickle_encode,
        pickle_decode,
        pickle_encode_row,
        pickle_decode_rows,
        trusted_only=True,
    ),
}


def get_codec(name: str) -> Codec:
    """The codec called ``name`` (``"safe"`` or ``"pickle"``); ValueError for others."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}") from None
