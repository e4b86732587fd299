"""The sample codecs: round trips, refusals that name the field, and hostile records."""

import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dbcache import (
    CodecError,
    RowDecodeError,
    get_codec,
    pickle_decode,
    pickle_encode,
    safe_decode,
    safe_encode,
    safe_encode_row,
)
from dbcache._codec import safe_decode_rows

pytestmark = pytest.mark.fast

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.binary(max_size=64)
    | st.text(max_size=32)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
samples = st.fixed_dictionaries(
    {"__key__": st.text(max_size=16), "__url__": st.text(max_size=16)},
    optional={"jpg": st.binary(max_size=256), "cls": st.integers(), "json": values},
)


def same(a, b):
    """Equal and of the same types all the way down (True must not come back as 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@given(values)
def test_safe_round_trip_values(value):
    assert same(safe_decode(safe_encode(value)), value)


@given(samples)
def test_safe_round_trip_samples(sample):
    assert same(safe_decode(safe_encode(sample)), sample)


@given(st.floats(allow_nan=True))
def test_floats_keep_their_bits(x):
    back = safe_decode(safe_encode(x))
    assert struct.pack("<d", back) == struct.pack("<d", x)


@given(st.integers(min_value=-(2**300), max_value=2**300))
def test_big_ints(n):
    assert safe_decode(safe_encode(n)) == n


@settings(max_examples=50)
@given(
    hnp.arrays(
        dtype=hnp.scalar_dtypes() | hnp.byte_string_dtypes() | hnp.unicode_string_dtypes(),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    )
)
def test_numpy_arrays_round_trip(array):
    back = safe_decode(safe_encode({"a": array}))["a"]
    assert isinstance(back, np.ndarray)
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()


def test_numpy_layouts_and_scalars():
    fortran = np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4))
    structured = np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")])
    sample = {"f": fortran, "s": structured, "x": np.float32(1.5), "i": np.int64(-3)}
    back = safe_decode(safe_encode(sample))
    np.testing.assert_array_equal(back["f"], fortran)
    assert back["s"].dtype == structured.dtype and back["s"].tolist() == structured.tolist()
    assert type(back["x"]) is np.float32 and back["x"] == np.float32(1.5)
    assert type(back["i"]) is np.int64 and back["i"] == -3


@pytest.mark.parametrize(
    "sample, field, typename",
    [
        ({"__key__": "k", "obj": object()}, "'obj'", "object"),
        ({"__key__": "k", "meta": {"tags": [1, 2, {3}]}}, "'meta'['tags'][2]", "set"),
        ({"__key__": "k", "buf": bytearray(b"x")}, "'buf'", "bytearray"),
        ({"__key__": "k", "d": {1: "a"}}, "'d'[1]", "int"),
        ({"__key__": "k", "o": np.array([object()])}, "'o'", "object"),
    ],
)
def test_unsupported_values_name_field_and_type(sample, field, typename):
    with pytest.raises(TypeError) as info:
        safe_encode(sample)
    assert field in str(info.value)
    assert typename in str(info.value)


def test_subclasses_are_refused_not_silently_converted():
    import enum

    class Colour(enum.IntEnum):
        RED = 1

    with pytest.raises(TypeError, match="Colour"):
        safe_encode({"c": Colour.RED})


class Boom:
    ran = False

    def __reduce__(self):
        return (exec, ("import tests_dbcache_flag",))


def test_safe_decode_refuses_pickles():
    payload = pickle.dumps({"__key__": "k", "x": Boom()})
    with pytest.raises(CodecError, match="pickle"):
        safe_decode(payload)


@given(st.binary(max_size=200))
def test_garbage_after_header_only_raises_codec_error(tail):
    try:
        safe_decode(b"SC\x01" + tail)
    except CodecError:
        pass


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"", "not a safe-codec record"),
        (b"SC\x01", "truncated"),
        (b"SC\x01b" + struct.pack("<Q", 10) + b"abc", "truncated"),
        (b"SC\x01l" + struct.pack("<Q", 2**60), "truncated"),
        (b"SC\x01Nxx", "trailing"),
        (b"SC\x01Z", "unknown tag"),
        (b"SC\x01" + b"l\x01\x00\x00\x00\x00\x00\x00\x00" * 100 + b"N", "nested deeper"),
        (b"SC\x01a" + struct.pack("<Q", 3) + b"abc", "bad numpy array"),
        (b"SC\x01s" + struct.pack("<Q", 1) + b"\xff", "UTF-8"),
    ],
)
def test_corrupt_records(blob, message):
    with pytest.raises(CodecError, match=message):
        safe_decode(blob)


def test_object_arrays_in_npy_records_are_refused():
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    data = buf.getvalue()
    with pytest.raises(CodecError, match="bad numpy array"):
        safe_decode(b"SC\x01a" + struct.pack("<Q", len(data)) + data)


def test_pickle_codec_round_trips_anything_picklable():
    sample = {"__key__": "k", "s": {1, 2}, "b": bytearray(b"x")}
    assert pickle_decode(pickle_encode(sample)) == sample
    assert get_codec("pickle").trusted_only
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("json")


@given(samples, st.data())
def test_damaged_sample_records_only_raise_codec_error(sample, data):
    blob = bytearray(safe_encode(sample))
    cut = data.draw(st.integers(min_value=3, max_value=len(blob)))
    flips = data.draw(st.lists(st.integers(min_value=3, max_value=len(blob) - 1), max_size=3))
    for i in flips:
        blob[i] ^= 0xFF
    for damaged in (bytes(blob), bytes(blob[:cut])):
        try:
            safe_decode(damaged)
        except CodecError:
            pass


row_samples = st.fixed_dictionaries(
    {"__key__": st.text(max_size=16)},
    optional={
        "__url__": st.text(max_size=16),
        "jpg": st.binary(max_size=256),
        "png": st.binary(max_size=64),
        "txt": st.text(max_size=16),
        "cls": st.integers(),
        "json": values,
    },
)


@given(row_samples)
def test_safe_row_round_trip_keeps_values_and_order(sample):
    fields, data, payload = safe_encode_row(sample)
    row = (sample.get("__url__", ""), sample["__key__"], fields, data, payload)
    (back,) = safe_decode_rows([row])
    assert same(back, sample) and list(back) == list(sample)


@given(row_samples, st.data())
def test_damaged_rows_only_raise_row_decode_error(sample, data):
    fields, blob, payload = safe_encode_row(sample)
    column = data.draw(st.sampled_from(["fields", "data"]))
    target = fields if column == "fields" else blob
    cut = data.draw(st.integers(0, len(target)))
    junk = data.draw(st.binary(max_size=8))
    damaged = target[:cut] + junk
    row = [sample.get("__url__", ""), sample["__key__"], fields, blob, payload]
    row[2 if column == "fields" else 3] = damaged
    try:
        list(safe_decode_rows([tuple(row)]))
    except RowDecodeError as exc:
        assert exc.key == sample["__key__"]
