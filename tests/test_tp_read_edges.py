"""The reader's tensor-parallel merge at its edges: records that must not merge (mixed dtypes,
a missing rank in one decode chunk) and replicated copies that must (identical copies
holding NaN). Records are built by hand; two real ranks are in tests/test_tp_capture.py."""

from __future__ import annotations

import pytest
import torch

from dmi.reader import assemble
from dmi.storage import RecordEntry, RecordKey, RecordMeta, ShardGeometry
from dmi.storage.errors import MissingShardError, ShardMergeError
from dmi.storage.records import ByteRange

FULL = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4)  # [tokens, features] of one chunk


def _rec(rank: int, *, dtype: str = "float32", sharded: bool = True, start: int = 0, n: int = 3) -> RecordEntry:
    """Rank ``rank`` of 2: columns ``2 * rank .. 2 * rank + 2`` of ``mlp_post`` when ``sharded``,
    else the whole ``resid_post`` (replicated), for tokens ``start .. start + n``."""
    hook = "mlp_post" if sharded else "resid_post"
    key = RecordKey("m", "r", "q", hook, 0, start, n, shard_rank=rank, tp_size=2)
    geom = ShardGeometry(1, 2 * rank, (n, 4)) if sharded else None
    shape = (n, 2 if sharded else 4)
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    meta = RecordMeta(key, dtype, shape, "raw", itemsize * n * shape[1], 0, shard=geom)
    return RecordEntry(meta, "p" * 32, ByteRange(0, 0))


def test_shards_of_different_dtypes_are_refused_not_promoted():
    """torch.cat would return float32 values rank 1 never stored as float32."""
    with pytest.raises(ShardMergeError, match=r"^request q hook mlp_post layer 0 token 0: the TP ranks' shards hold "
                                              r"different dtypes \{0: 'torch.float32', 1: 'torch.float16'\}; "
                                              r"read each rank with shard_rank=$"):
        assemble([_rec(1, dtype="float16"), _rec(0)], [FULL[:, 2:].half(), FULL[:, :2]])
    shard = assemble([_rec(1, dtype="float16"), _rec(0)], [FULL[:, 2:].half(), FULL[:, :2]], shard_rank=1)
    assert shard.dtype == torch.float16 and torch.equal(shard, FULL[None, :, 2:].half())


def test_identical_replicated_copies_holding_nan_read_as_one():
    """NaN != NaN: identical copies must not be called different because they hold one."""
    copy = FULL.clone()
    copy[1, 2] = float("nan")
    got = assemble([_rec(0, sharded=False), _rec(1, sharded=False)], [copy, copy.clone()])
    assert got.shape == (1, 3, 4)
    assert torch.equal(got[0].isnan(), copy.isnan())
    assert torch.equal(got[0].nan_to_num(-1.0), copy.nan_to_num(-1.0))


def test_replicated_copies_with_nan_in_other_places_differ():
    a, b = FULL.clone(), FULL.clone()
    a[0, 0] = float("nan")
    b[0, 1] = float("nan")
    with pytest.raises(ShardMergeError, match=r"differ between TP rank 0 and rank\(s\) \[1\]"):
        assemble([_rec(0, sharded=False), _rec(1, sharded=False)], [a, b])


def test_replicated_copies_of_different_dtypes_differ_even_with_equal_values():
    """The values convert exactly, but one rank stored float64: not one tensor twice."""
    with pytest.raises(ShardMergeError, match=r"differ between TP rank 0 and rank\(s\) \[1\]"):
        assemble([_rec(0, sharded=False), _rec(1, dtype="float64", sharded=False)], [FULL, FULL.double()])


def test_a_rank_missing_from_one_decode_chunk_is_named():
    """Prefill (tokens 0..3) has both ranks, the decode step at token 3 only rank 0."""
    step = torch.full((1, 4), 7.0)
    entries = [_rec(0), _rec(1), _rec(0, start=3, n=1)]
    with pytest.raises(MissingShardError, match=r"token 3: the shards of TP rank\(s\) \[1\] of 2 are missing") as info:
        assemble(entries, [FULL[:, :2], FULL[:, 2:], step[:, :2]])
    assert (info.value.present, info.value.missing) == ((0,), (1,))
    merged = assemble([*entries, _rec(1, start=3, n=1)], [FULL[:, :2], FULL[:, 2:], step[:, :2], step[:, 2:]])
    assert torch.equal(merged, torch.cat([FULL, step])[None])
