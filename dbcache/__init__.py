"""DBCache: an SQLite sample store for fixed validation sets.

``DBCache(dbname, size, source)`` stores the first ``size`` samples of ``source`` in one
SQLite file and serves every later pass from it. Samples are stored with the ``safe``
codec (no pickle) unless ``codec="pickle"`` is asked for explicitly, for trusted files.
"""

from dbcache._codec import (
    CODECS,
    Codec,
    CodecError,
    RowDecodeError,
    get_codec,
    pickle_decode,
    pickle_encode,
    safe_decode,
    safe_encode,
    safe_encode_row,
)
from dbcache._db import FORMAT_VERSION, DBCache, DBCacheError, get_uuid, sample_ident

__all__ = [
    "DBCache",
    "DBCacheError",
    "get_uuid",
    "sample_ident",
    "FORMAT_VERSION",
    "Codec",
    "CodecError",
    "RowDecodeError",
    "CODECS",
    "get_codec",
    "safe_encode",
    "safe_encode_row",
    "safe_decode",
    "pickle_encode",
    "pickle_decode",
]
