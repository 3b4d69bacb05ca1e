"""Reassembly: token order, per-layer stacking, duplicates refused, shards selected or merged."""

import pytest
import torch

from dmi.storage import (
    GLOBAL_LAYER,
    DuplicateChunkError,
    InvalidArgumentError,
    PackStore,
    PackWriter,
    ReaderError,
    RecordEntry,
    RecordKey,
    RecordMeta,
    RecordNotFoundError,
    ShardGeometry,
    ShardMergeError,
)
from dmi.storage.records import ByteRange
from dmi.reader import assemble, read_records

FULL = torch.arange(3 * 12 * 8, dtype=torch.float32).reshape(3, 12, 8)  # [layers, tokens, hidden]


def rec(layer, start, n, *, hook="resid_post", request="req", rank=0, tp=1, shard=None, run="run", shape=None,
        token_axis=0, key_axis=None):
    key = RecordKey("model", run, request, hook, layer, start, n, shard_rank=rank, tp_size=tp)
    meta = RecordMeta(key=key, dtype="float32", shape=shape or (n, 8), codec="raw", raw_size=0, checksum=0, shard=shard,
                      token_axis=token_axis, key_axis=key_axis)
    return RecordEntry(meta=meta, pack_id="0" * 32, payload=ByteRange(0, 0))


def chunks(layers=(0, 1, 2), cuts=(0, 5, 6, 12)):
    entries, tensors = [], []
    for layer in layers:
        for a, b in zip(cuts, cuts[1:]):
            entries.append(rec(layer, a, b - a))
            tensors.append(FULL[layer, a:b].clone())
    return entries, tensors


def test_token_order_and_layer_stacking():
    entries, tensors = chunks()
    order = [7, 0, 4, 8, 2, 1, 5, 3, 6]  # any input order
    got = assemble([entries[i] for i in order], [tensors[i] for i in order])
    assert torch.equal(got, FULL)


def test_layer_subset_stacks_in_ascending_order():
    entries, tensors = chunks(layers=(2, 0))
    assert torch.equal(assemble(entries, tensors), FULL[[0, 2]])


def test_global_hook_has_no_layer_axis():
    ids = torch.arange(12)
    entries = [rec(GLOBAL_LAYER, 0, 7, hook="token_ids", shape=(7,)), rec(GLOBAL_LAYER, 7, 5, hook="token_ids", shape=(5,))]
    got = assemble(entries[::-1], [ids[7:], ids[:7]])
    assert torch.equal(got, ids)


def test_duplicate_chunks_refused_with_names():
    entries, tensors = chunks(layers=(1,))
    entries.append(rec(1, 5, 1, rank=1, tp=2))
    tensors.append(FULL[1, 5:6])
    with pytest.raises(DuplicateChunkError) as info:
        assemble(entries, tensors)
    msg = str(info.value)
    for part in ("req", "resid_post", "layer 1", "[5]", "shard_rank=", "ranks [0, 1]"):
        assert part in msg, part


def test_duplicate_from_two_runs_names_the_runs():
    entries, tensors = chunks(layers=(0,))
    entries.append(rec(0, 0, 5, run="other-run"))
    tensors.append(FULL[0, :5])
    with pytest.raises(DuplicateChunkError, match="other-run"):
        assemble(entries, tensors)


def test_shard_rank_selects():
    entries, tensors = chunks(layers=(0,))
    for e in list(entries):
        entries.append(rec(0, e.meta.key.start_token, e.meta.key.n_tokens, rank=1, tp=2))
        tensors.append(torch.zeros(e.meta.key.n_tokens, 8))
    entries = [_with_rank(e, 0, 2) if e.meta.key.shard_rank == 0 else e for e in entries]
    assert torch.equal(assemble(entries, tensors, shard_rank=0), FULL[:1])  # one layer: [1, ...]
    assert torch.equal(assemble(entries, tensors, shard_rank=1), torch.zeros(1, 12, 8))
    with pytest.raises(RecordNotFoundError, match=r"ranks present: \[0, 1\]"):
        assemble(entries, tensors, shard_rank=3)


def _with_rank(e, rank, tp):
    k = e.meta.key
    return rec(k.layer, k.start_token, k.n_tokens, rank=rank, tp=tp)


def sharded(axis_len=8, offsets=(0, 4), sizes=(4, 4), layer=0, full=None):
    full = FULL[layer] if full is None else full
    entries, tensors = [], []
    for rank, (off, size) in enumerate(zip(offsets, sizes)):
        geom = ShardGeometry(axis=1, offset=off, full_shape=(12, axis_len))
        entries.append(rec(layer, 0, 12, rank=rank, tp=len(offsets), shard=geom, shape=(12, size)))
        tensors.append(full[:, off : off + size].clone())
    return entries, tensors


def test_merge_shards_by_geometry():
    entries, tensors = sharded()
    got = assemble(entries[::-1], tensors[::-1], merge_shards=True)
    assert torch.equal(got, FULL[:1])
    e2, t2 = sharded(layer=1)
    assert torch.equal(assemble(entries + e2, tensors + t2, merge_shards=True), FULL[:2])


def test_merge_refuses_replicated_kv():
    entries, tensors = sharded(offsets=(0, 0), sizes=(8, 8))
    with pytest.raises(ShardMergeError, match="replicated"):
        assemble(entries, tensors, merge_shards=True)
    assert torch.equal(assemble(entries, tensors, shard_rank=1), FULL[:1])


def test_replicated_copies_are_deduplicated_and_must_agree():
    """Records without geometry from every TP rank are copies of one tensor: one is returned."""
    entries = [rec(0, 0, 12, rank=0, tp=2), rec(0, 0, 12, rank=1, tp=2)]
    assert torch.equal(assemble(entries, [FULL[0], FULL[0].clone()]), FULL[:1])
    with pytest.raises(ShardMergeError, match=r"differ between TP rank 0 and rank\(s\) \[1\]"):
        assemble(entries, [FULL[0], FULL[0] + 1])


def test_merge_refuses_gap_and_wrong_full_shape():
    entries, tensors = sharded(offsets=(0, 5), sizes=(4, 3))
    with pytest.raises(ShardMergeError, match="tile"):
        assemble(entries, tensors, merge_shards=True)
    entries, tensors = sharded(axis_len=9)
    with pytest.raises(ShardMergeError, match="full shape"):
        assemble(entries, tensors, merge_shards=True)


def test_missing_and_overlapping_tokens_refused():
    entries, tensors = chunks(layers=(0,))
    with pytest.raises(ReaderError, match="missing"):
        assemble([entries[0], entries[2]], [tensors[0], tensors[2]])
    entries.append(rec(0, 4, 2))
    tensors.append(FULL[0, 4:6])
    with pytest.raises(ReaderError, match="overlapping"):
        assemble([entries[0], entries[3], entries[2]], [tensors[0], tensors[3], tensors[2]])


def test_scope_and_argument_checks():
    entries, tensors = chunks(layers=(0,))
    with pytest.raises(InvalidArgumentError):
        assemble(entries, tensors[:-1])
    with pytest.raises(InvalidArgumentError, match="one \\(request, hook\\)"):
        assemble(entries + [rec(0, 12, 1, request="other")], tensors + [FULL[0, :1]])
    with pytest.raises(InvalidArgumentError):
        assemble(entries, tensors, shard_rank=0, merge_shards=True)
    with pytest.raises(RecordNotFoundError):
        assemble([], [])


def test_round_trip_through_a_pack(tmp_path):
    store = PackStore.local(tmp_path)
    entries, tensors = chunks()
    with PackWriter(store) as w:
        for e, t in zip(entries, tensors):
            w.append(e.meta.key, t.to(torch.bfloat16))
        desc = w.seal()
    got = assemble(desc.records, read_records(store, desc.records))
    assert torch.equal(got.view(torch.int16), FULL.to(torch.bfloat16).view(torch.int16))


def pattern(layer, start, n, shape, hook="attn_pattern"):
    return rec(layer, start, n, hook=hook, shape=shape, token_axis=1, key_axis=2)


@pytest.mark.parametrize("hook", ["attn_pattern", "any_name"])
def test_attention_patterns_join_on_the_query_axis_with_causal_zeros(hook):
    """Prefill [h, 3, 3] then two decode steps [h, 1, 4], [h, 1, 5] -> the full [h, 5, 5] pattern.
    The recorded layout decides, not the hook's name."""
    heads = 2
    full = torch.tril(torch.rand(heads, 5, 5) + 0.1)  # causal: zero above the diagonal
    pieces = [(0, 3), (3, 1), (4, 1)]
    entries = [pattern(0, a, n, (heads, n, a + n), hook=hook) for a, n in pieces]
    tensors = [full[:, a : a + n, : a + n].clone() for a, n in pieces]
    got = assemble(entries[::-1], tensors[::-1])
    assert got.shape == (1, heads, 5, 5)
    assert torch.equal(got[0], full)


def test_chunks_with_different_layouts_refused():
    entries = [pattern(0, 0, 2, (2, 2, 2)), rec(0, 2, 1, hook="attn_pattern", shape=(1, 2, 3))]
    with pytest.raises(ReaderError, match="different token layouts"):
        assemble(entries, [torch.zeros(2, 2, 2), torch.zeros(1, 2, 3)])


def test_attention_pattern_chunks_must_carry_tokens_on_axis_1():
    entries = [pattern(0, 0, 2, (2, 2, 2)), pattern(0, 2, 1, (2, 3, 3))]
    with pytest.raises(ReaderError, match="tokens not on axis 1"):
        assemble(entries, [torch.zeros(2, 2, 2), torch.zeros(2, 3, 3)])


def test_layers_starting_at_other_tokens_are_not_stacked():
    """Equal shapes are not enough: row t of every stacked layer must be the same token."""
    entries = [rec(0, 0, 4), rec(1, 4, 4)]
    with pytest.raises(ReaderError, match=r"layers start at different tokens \{0: 0, 1: 4\}"):
        assemble(entries, [FULL[0, :4], FULL[1, 4:8]])


def test_chunks_or_layers_of_different_dtypes_are_not_promoted():
    entries = [rec(0, 0, 5), rec(0, 5, 7)]
    with pytest.raises(ReaderError, match="chunks hold different dtypes"):
        assemble(entries, [FULL[0, :5].to(torch.int64), FULL[0, 5:]])
    entries = [rec(0, 0, 12), rec(1, 0, 12)]
    with pytest.raises(ReaderError, match="layers hold different dtypes"):
        assemble(entries, [FULL[0].to(torch.bfloat16), FULL[1]])


def test_merge_refuses_a_shard_that_disagrees_off_its_axis():
    entries, tensors = sharded()
    tensors[1] = tensors[1][:11]
    with pytest.raises(ShardMergeError, match=r"TP rank 1's shard \(11, 4\) does not fit the full shape \(12, 8\)"):
        assemble(entries, tensors, merge_shards=True)
