"""PackWriter → sealed pack → read back: bit-exact for every dtype, limits, descriptors."""

import dataclasses
import math
import os
import sys
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

from dmi.storage import (
    CODECS,
    InvalidArgumentError,
    LocalPackStore,
    PackError,
    PackSealError,
    PackStore,
    PackWriter,
    RecordKey,
    ShardGeometry,
    UnsupportedDtypeError,
    read_pack_descriptor,
    verify_pack,
)
from dmi.storage import _writer
from dmi.storage._pack_format import FORMAT_VERSION, _dtype_table
from dmi.reader import read_record, read_records


def key(layer=0, start=0, n=4, hook="resid_post", request="req-1", rank=0, tp=1):
    return RecordKey("model", "run", request, hook, layer, start, n, shard_rank=rank, tp_size=tp)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


def random_tensor(dtype: torch.dtype, shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


_DTYPES = _dtype_table()
STORABLE = sorted(n for n, d in _DTYPES.items() if not n.startswith(("qint", "quint")))


@pytest.fixture
def store(tmp_path):
    return PackStore.local(tmp_path / "packs")


@pytest.mark.parametrize("codec", CODECS)
def test_every_dtype_round_trips_bit_exact(store, codec):
    tensors = {name: random_tensor(_DTYPES[name], (3, 5), seed=i) for i, name in enumerate(STORABLE)}
    with PackWriter(store, codec=codec) as w:
        for i, t in enumerate(tensors.values()):
            w.append(key(layer=i), t)
        desc = w.seal()
    got = read_records(store, desc.records)
    for name, e, g in zip(tensors, desc.records, got):
        assert e.meta.dtype == name
        assert same_bits(g, tensors[name]), name
        assert same_bits(read_record(store, e), tensors[name]), name


@pytest.mark.parametrize("codec", CODECS)
def test_read_records_puts_reads_and_decoded_records_in_the_memory_given(store, codec):
    """``memory=`` (the training loader's reused window memory): every record bit-exact, and
    every byte it returns lies in the region the caller lent."""
    from dmi._loader_memory import Arena

    tensors = [random_tensor(torch.bfloat16, (64, 33), seed=i) for i in range(4)]
    with PackWriter(store, codec=codec) as w:
        for i, t in enumerate(tensors):
            w.append(key(layer=i), t)
        desc = w.seal()
    region = torch.empty(Arena.room_for([e.payload.length + e.meta.raw_size for e in desc.records]), dtype=torch.uint8)
    got = read_records(store, desc.records, memory=Arena(region))
    lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
    for g, t in zip(got, tensors):
        assert same_bits(g, t)
        assert lo <= g.data_ptr() and g.data_ptr() + g.numel() * g.element_size() <= hi


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor(3.5, dtype=torch.bfloat16),  # 0-dim
        lambda: torch.empty(0, 7, dtype=torch.float16),  # empty
        lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),  # non-contiguous
        lambda: torch.arange(40, dtype=torch.int64).reshape(4, 10)[:, ::3],  # strided slice
        lambda: torch.randn(5, 3, dtype=torch.complex64).conj(),  # lazy conjugate bit
        lambda: torch.randn(16, 8).to(torch.float8_e4m3fn),
        lambda: torch.randn(4, 4, requires_grad=True) * 2,  # autograd graph attached
    ],
)
def test_shapes_and_layouts_round_trip(store, codec, make):
    t = make()
    with PackWriter(store, codec=codec) as w:
        w.append(key(), t)
        desc = w.seal()
    got = read_record(store, desc.records[0])
    assert same_bits(got, t.detach().resolve_conj())
    assert desc.records[0].meta.shape == tuple(t.shape)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_dtype_refused(store):
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8)
    with PackWriter(store) as w, pytest.raises(UnsupportedDtypeError, match="dequantize"):
        w.append(key(), q)


@pytest.mark.parametrize("payload", [bytes(range(16)), bytearray(range(16)), memoryview(bytes(range(16))), np.arange(16, dtype=np.uint8)])
def test_bytes_payloads(store, payload):
    with PackWriter(store) as w:
        w.append(key(), payload)
        w.append(key(layer=1), payload, dtype="int16", shape=(2, 4))
        w.append(key(layer=2), payload, dtype=torch.bfloat16, shape=(8,))
        desc = w.seal()
    a, b, c = read_records(store, desc.records)
    assert a.dtype == torch.uint8 and a.tolist() == list(range(16))
    assert same_bits(b, torch.frombuffer(bytearray(range(16)), dtype=torch.int16).reshape(2, 4))
    assert c.dtype == torch.bfloat16 and c.shape == (8,)


def test_bytes_payload_shape_must_fit(store):
    with PackWriter(store) as w, pytest.raises(InvalidArgumentError, match="do not hold"):
        w.append(key(), b"\0" * 10, dtype="float32", shape=(3,))


def test_stats_match_float64_reference(store):
    t = torch.randn(64, 32).to(torch.bfloat16)
    with PackWriter(store) as w:
        w.append(key(), t)
        w.append(key(layer=1), torch.empty(0))
        desc = w.seal()
    s = desc.records[0].meta.stats
    ref = t.double()
    assert s.l2_norm == pytest.approx(ref.norm().item(), rel=1e-5)
    assert s.mean == pytest.approx(ref.mean().item(), rel=1e-4, abs=1e-6)
    assert s.absmax == ref.abs().max().item()
    assert desc.records[1].meta.stats is None
    with PackWriter(store, stats=False) as w:
        w.append(key(), t)
        assert w.seal().records[0].meta.stats is None


def test_descriptor_matches_file_for_every_batching(store):
    """Offsets predicted at write time equal those found by walking the file's buffers."""
    sizes = [0, 1, 100, 4096, 70_000, 300_000, 3, 2_000_000, 17]
    for batch_bytes in (1, 1000, 64 * 1024, 300_001, 1 << 30):
        with PackWriter(store, codec="raw", batch_bytes=batch_bytes) as w:
            for i, n in enumerate(sizes):
                w.append(key(layer=i, n=n), torch.arange(n, dtype=torch.uint8))
            desc = w.seal()
        assert verify_pack(store, desc.pack_id) == desc
        assert read_pack_descriptor(store, desc.pack_id) == desc
        for e, n in zip(desc.records, sizes):
            assert e.payload.length == n
            assert same_bits(read_record(store, e), torch.arange(n, dtype=torch.uint8))


def test_descriptor_fields(store):
    seen = []
    geom = ShardGeometry(axis=1, offset=64, full_shape=(4, 128))
    with PackWriter(store, writer_id="drain-7", on_seal=seen.append) as w:
        w.append(key(rank=1, tp=2), torch.ones(4, 64), shard=geom)
        desc = w.seal()
    assert seen == [desc]
    assert desc.writer_id == "drain-7" and desc.format_version == FORMAT_VERSION
    assert desc.location == store.location(desc.pack_id)
    assert desc.size == os.path.getsize(desc.location)
    assert desc.records[0].meta.shard == geom
    assert store.list_packs() == [desc.pack_id]


def test_seals_at_max_records(store):
    seen = []
    with PackWriter(store, max_records=3, on_seal=seen.append) as w:
        for i in range(7):
            w.append(key(layer=i), torch.full((2,), i))
    assert [len(d.records) for d in seen] == [3, 3, 1]
    assert sorted(store.list_packs()) == sorted(d.pack_id for d in seen)
    layers = [e.meta.key.layer for d in seen for e in d.records]
    assert layers == list(range(7))


def test_seals_before_passing_max_bytes(store):
    seen = []
    with PackWriter(store, codec="raw", max_bytes=1000, on_seal=seen.append) as w:
        for i in range(5):
            w.append(key(layer=i), torch.zeros(400, dtype=torch.uint8))
        w.append(key(layer=9), torch.zeros(3000, dtype=torch.uint8))  # bigger than the limit alone
    assert [[e.payload.length for e in d.records] for d in seen] == [[400, 400], [400, 400], [400], [3000]]


def test_empty_seal_and_close(store):
    w = PackWriter(store)
    assert w.seal() is None
    assert w.close() is None
    assert w.close() is None
    with pytest.raises(PackError, match="closed"):
        w.append(key(), torch.zeros(1))
    assert store.list_packs() == []


def test_abort_leaves_nothing(store):
    w = PackWriter(store)
    w.append(key(), torch.zeros(10))
    w.abort()
    assert store.list_packs() == [] and os.listdir(store.root) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"codec": "lz4"}, {"max_records": 0}, {"max_bytes": -1}, {"batch_bytes": 0}, {"batch_bytes": True}],
)
def test_bad_arguments(store, kwargs):
    with pytest.raises(InvalidArgumentError):
        PackWriter(store, **kwargs)


def test_tensor_with_dtype_argument_refused(store):
    with PackWriter(store) as w, pytest.raises(InvalidArgumentError):
        w.append(key(), torch.zeros(2), dtype="float16")


@pytest.fixture
def fast_switching():
    """Make the interpreter switch threads as often as it can, so races show up."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_concurrent_appends(store, fast_switching):
    seen = []
    tensors = {(t, i): torch.full((64,), t * 1000 + i, dtype=torch.int32) for t in range(4) for i in range(50)}
    with PackWriter(store, max_records=3, batch_bytes=200, on_seal=seen.append) as w:

        def work(t):
            for i in range(50):
                w.append(key(layer=i, request=f"r{t}"), tensors[(t, i)])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    entries = [e for d in seen for e in d.records]
    assert len(entries) == 200 and all(len(d.records) <= 3 for d in seen)
    assert sorted(store.list_packs()) == sorted(d.pack_id for d in seen)
    for e, got in zip(entries, read_records(store, entries)):
        k = e.meta.key
        assert torch.equal(got, tensors[(int(k.request_id[1:]), k.layer)])


def test_small_records_gathered_into_batches_of_at_most_batch_bytes(store):
    """Records below ``batch_bytes`` share record batches of at most ``batch_bytes`` payload
    bytes; one of at least ``batch_bytes`` is a batch of its own."""
    sizes = [300] * 7 + [1000] + [300] * 2
    with PackWriter(store, codec="raw", batch_bytes=1000) as w:
        for i, n in enumerate(sizes):
            w.append(key(layer=i), torch.full((n,), i, dtype=torch.uint8))
        desc = w.seal()
    with pa.OSFile(desc.location) as f:
        reader = pa.ipc.open_file(f)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches - 1)]  # the last: the index
    assert [b.num_rows for b in batches] == [3, 3, 1, 1, 2]
    assert [b.column("layer").to_pylist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6], [7], [8, 9]]
    for e, got in zip(desc.records, read_records(store, desc.records)):
        assert torch.equal(got, torch.full((e.payload.length,), e.meta.key.layer, dtype=torch.uint8))


def test_a_gathered_batch_outgrowing_its_first_buffer_keeps_every_byte(store, monkeypatch):
    """With ``batch_bytes`` above the first buffer's size, the gathered batch moves to a
    larger buffer as it fills; what was gathered before comes along."""
    monkeypatch.setattr(_writer, "_GATHER_START", 1000)
    sizes = [700, 900, 50, 2500, 10]
    with PackWriter(store, codec="raw", batch_bytes=1 << 20) as w:
        for i, n in enumerate(sizes):
            w.append(key(layer=i), torch.full((n,), i + 1, dtype=torch.uint8))
        desc = w.seal()
    assert verify_pack(store, desc.pack_id) == desc
    got = read_records(store, desc.records)
    assert [t.tolist() for t in got] == [[i + 1] * n for i, n in enumerate(sizes)]


@pytest.mark.parametrize("codec", CODECS)
def test_caller_may_reuse_its_buffer_after_append(store, codec):
    """A drain thread frees its ring slot as soon as append returns."""
    slot = torch.arange(256, dtype=torch.float32)
    expected = slot.clone()
    with PackWriter(store, codec=codec) as w:
        w.append(key(), slot)  # small: waits in the pending batch
        w.append(key(layer=1), slot.view(torch.uint8).numpy())
        slot.fill_(-1)
        desc = w.seal()
    a, b = read_records(store, desc.records)
    assert torch.equal(a, expected)
    assert torch.equal(b, expected.view(torch.uint8))


@pytest.mark.parametrize(
    "t, l2, mean, absmax",
    [
        (torch.zeros(4), 0.0, 0.0, 0.0),
        (torch.tensor([3.0, -4.0], dtype=torch.float16), 5.0, -0.5, 4.0),
        (torch.tensor([3 + 4j, 0j], dtype=torch.complex64), 5.0, 2.5, 5.0),
        (torch.tensor([-128, 2], dtype=torch.int8), math.hypot(128, 2), -63.0, 128.0),
        (torch.tensor([True, False, True]), math.sqrt(2), 2 / 3, 1.0),
        (torch.tensor([1.0, float("inf")]).to(torch.bfloat16), math.inf, math.inf, math.inf),
        (torch.tensor([3e38, 3e38]), pytest.approx(3e38 * math.sqrt(2)), pytest.approx(3e38), pytest.approx(3e38)),
        (torch.tensor([1.0, float("inf"), float("-inf")]), math.inf, math.nan, math.inf),
        (torch.tensor([1.0, float("nan"), -3.0]), math.nan, math.nan, math.nan),
        (torch.full((100,), -0.0, dtype=torch.bfloat16), 0.0, 0.0, 0.0),
        (torch.tensor([1e308, 1e308], dtype=torch.float64), math.inf, math.inf, 1e308),  # the sum passes float64
    ],
    ids=["zeros", "float16", "complex", "int8", "bool", "bf16-inf", "squares-past-float32", "inf-minus-inf", "nan",
         "negative-zeros", "sum-past-float64"],
)
def test_stats_values(store, t, l2, mean, absmax):
    with PackWriter(store) as w:
        w.append(key(), t)
        s = w.seal().records[0].meta.stats
    assert (s.l2_norm, s.mean) == (pytest.approx(l2, nan_ok=True), pytest.approx(mean, nan_ok=True))
    assert s.absmax == absmax or math.isnan(s.absmax) and math.isnan(absmax)  # exact: no sum involved
    assert not [v for v in (s.l2_norm, s.mean, s.absmax) if v == 0 and math.copysign(1.0, v) < 0]  # no -0.0


@pytest.mark.parametrize("axes", [(2, None), (-1, None), (0, 0), (1, 2), (True, None), (False, None), (0.0, None)])
def test_token_layout_must_name_distinct_axes_of_the_shape(tmp_path, axes):
    token_axis, key_axis = axes
    with PackWriter(PackStore.local(tmp_path)) as w:
        with pytest.raises(InvalidArgumentError, match="not distinct axes of shape"):
            w.append(RecordKey("m", "r", "q", "h", 0, 0, 4), torch.zeros(4, 8), token_axis=token_axis, key_axis=key_axis)
        w.append(RecordKey("m", "r", "q", "h", 0, 0, 4), torch.zeros(2, 4, 4), token_axis=1, key_axis=2)
        (entry,) = w.seal().records
    assert (entry.meta.token_axis, entry.meta.key_axis) == (1, 2)


@pytest.mark.parametrize(
    "fields, shard, message",
    [
        ({"layer": "x"}, None, "layer must be an int, got str 'x'"),
        ({"layer": True}, None, "layer must be an int, got bool"),
        ({"layer": np.int64(3)}, None, "layer must be an int, got int64"),
        ({"layer": 2**31}, None, r"layer 2147483648 does not fit its column \(-2147483648\.\.2147483647\)"),
        ({"start_token": -(2**63) - 1}, None, "start_token -9223372036854775809 does not fit"),
        ({"hook": 5}, None, "hook must be a str, got int 5"),
        ({"hook": "h\ud800"}, None, r"hook 'h\\ud800' is not valid Unicode text"),
        ({}, ShardGeometry(1, 0, 8), "full_shape must be a tuple of ints, got int 8"),
        ({}, ShardGeometry("0", 0, (4, 8)), "shard_axis must be an int"),
        ({}, ShardGeometry(1, 0, (4, 2.0)), "full_shape holds 2.0: every item must be an int"),
    ],
)
def test_unstorable_key_is_refused_alone(store, fields, shard, message):
    """A key (or shard) that does not fit its columns is refused at append; the records appended
    before it seal intact (found at the seal instead, it failed its whole pack)."""
    good = torch.arange(4.0)
    with PackWriter(store) as w:
        w.append(key(), good)
        with pytest.raises(InvalidArgumentError, match=message):
            w.append(dataclasses.replace(key(layer=1), **fields), good, shard=shard)
        desc = w.seal()
    assert [e.meta.key for e in desc.records] == [key()]
    assert torch.equal(read_records(store, desc.records)[0], good)


def test_keys_at_the_ends_of_their_columns_are_stored(store):
    """The integer ranges checked at append are the columns' own: their ends round-trip."""
    edge = RecordKey("m", "r", "q", "h", 2**31 - 1, 2**63 - 1, -(2**63), step=-(2**63), shard_rank=-(2**31))
    shard = ShardGeometry(-(2**31), 2**63 - 1, (2**63 - 1, 0))
    with PackWriter(store) as w:
        w.append(edge, torch.zeros(1), shard=shard)
        desc = w.seal()
    assert read_pack_descriptor(store, desc.pack_id) == desc
    assert (desc.records[0].meta.key, desc.records[0].meta.shard) == (edge, shard)


def test_a_writers_first_seal_imports_nothing(tmp_path):
    """pyarrow's lazy imports (pandas, from its first list conversion) run when the writer is
    made, before a capture starts — not at its first seal, on the drain thread beside the model.
    In a fresh interpreter: no module may be imported between the writer's creation and the end
    of its first seal."""
    import subprocess

    script = """
import sys, torch
from dmi.storage import PackStore, PackWriter, RecordKey
writer = PackWriter(PackStore.local(sys.argv[1]))
before = set(sys.modules)
writer.append(RecordKey("model", "run", "req-1", "resid_post", 0, 0, 4), torch.ones(4, 8))
assert writer.seal() is not None
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "packs")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:400]


@pytest.mark.parametrize("shape", [(2**63, 0), (-1, -4), (2.0, 2), (True, 4), "ab"])
def test_a_bad_bytes_shape_is_refused_alone(store, shape):
    """Refused at append, before it joins a pack: left to the seal it took the pack's other
    records with it (an Arrow overflow), or stored a shape no reader can build."""
    with PackWriter(store) as w:
        w.append(key(), torch.ones(4))
        with pytest.raises(InvalidArgumentError, match="shape"):
            w.append(key(layer=1), b"\0" * 16 if shape != (2**63, 0) else b"", dtype="float32", shape=shape)
        desc = w.seal()
    assert [e.meta.key.layer for e in desc.records] == [0]
    assert sorted(os.listdir(store.root)) == [f"{desc.pack_id}.arrow"]


@pytest.mark.parametrize("name", ["qint8", "quint8", "qint32"])
def test_quantized_dtype_refused_for_bytes_too(store, name):
    with PackWriter(store) as w, pytest.raises(UnsupportedDtypeError, match="dequantize"):
        w.append(key(), bytearray(4), dtype=name, shape=(4,))


def test_read_only_bytes_get_statistics_and_lossy_codecs(store):
    """A ``bytes`` payload is described as a ``bytearray`` of the same bytes is."""
    values = torch.linspace(-2, 2, 16)
    payload = values.numpy().tobytes()
    with PackWriter(store) as w:
        w.append(key(), payload, dtype="float32", shape=(4, 4))
        w.append(key(layer=1), bytearray(payload), dtype="float32", shape=(4, 4))
        w.append(key(layer=2), payload, dtype="float32", shape=(4, 4), codec="int8")
        desc = w.seal()
    readonly, writable, lossy = desc.records
    assert readonly.meta.stats is not None and readonly.meta.stats == writable.meta.stats
    assert lossy.meta.codec == "int8" and lossy.meta.stats == writable.meta.stats


@pytest.mark.parametrize("writer_id", ["\ud800", 123])
def test_a_bad_writer_id_is_refused_before_any_file(store, writer_id):
    with pytest.raises(InvalidArgumentError, match="writer_id"):
        PackWriter(store, writer_id=writer_id)
    assert not os.path.exists(store.root) or os.listdir(store.root) == []


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_temporary_file_that_cannot_be_removed_is_named_and_the_writer_goes_on(tmp_path, monkeypatch, direct):
    """A failed write on a filesystem gone read-only: the error says the pack and its records
    were lost and which temporary file is left; the writer drops that pack and starts a new one.
    (The failures are injected: a real remount read-only cannot be made here.)"""
    import errno

    store = LocalPackStore(tmp_path / "packs", direct_writes=direct)
    w = PackWriter(store)
    w.append(key(), torch.ones(4))

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    def cannot_unlink(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)

    real_unlink = os.unlink
    monkeypatch.setattr(os, "fsync", fail)
    monkeypatch.setattr(os, "unlink", cannot_unlink)
    with pytest.raises(PackSealError, match=r"records lost|nothing published") as info:
        w.seal()
    left = [n for n in os.listdir(store.root) if n.endswith(".tmp")]
    assert len(left) == 1 and left[0] in str(info.value) and "delete it by hand" in str(info.value)
    monkeypatch.undo()
    real_unlink(os.path.join(store.root, left[0]))
    w.append(key(layer=1), torch.full((4,), 2.0))
    desc = w.close()
    assert [e.meta.key.layer for e in desc.records] == [1]
    assert read_records(store, desc.records)[0].tolist() == [2.0] * 4


def test_a_refused_key_with_a_lone_surrogate_can_be_printed(store):
    bad = RecordKey("model", "run", "req-\ud800", "resid_post", 0, 0, 4)
    with PackWriter(store) as w, pytest.raises(InvalidArgumentError) as info:
        w.append(bad, torch.ones(4))
    assert "req-\\ud800" in str(info.value)
    str(info.value).encode("utf-8")  # would raise UnicodeEncodeError with the surrogate itself
