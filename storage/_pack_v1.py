"""Reading format v1 packs: their row schema, and their index in today's field columns.

Format v1 (the first release) ordered its columns differently and named four of them
differently in its rows (``shard_full_shape`` and the three ``stat_*``), stored a missing shard axis as null, and nested shard
and statistics in its index. Its records hold record schema version 1: the fields added
since (the token layout) come from their legacy rules in ``RECORD_FIELDS``, applied by the
index decoder for every older version alike. Nothing here is used to write.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = ["V1_PACK_ROW_SCHEMA", "decode_v1_columns"]

_list_i64 = pa.list_(pa.int64())

V1_PACK_ROW_SCHEMA = pa.schema(
    [
        ("model_id", pa.string()),
        ("run_id", pa.string()),
        ("request_id", pa.string()),
        ("hook", pa.string()),
        ("layer", pa.int32()),
        ("shard_rank", pa.int32()),
        ("tp_size", pa.int32()),
        ("start_token", pa.int64()),
        ("n_tokens", pa.int64()),
        ("step", pa.int64()),
        ("phase", pa.string()),
        ("dtype", pa.string()),
        ("shape", _list_i64),
        ("shard_axis", pa.int32()),
        ("shard_offset", pa.int64()),
        ("shard_full_shape", _list_i64),
        ("codec", pa.string()),
        ("raw_size", pa.int64()),
        ("checksum", pa.uint64()),
        ("stat_l2_norm", pa.float64()),
        ("stat_mean", pa.float64()),
        ("stat_absmax", pa.float64()),
        ("payload", pa.large_binary()),
    ]
)
"""Columns of a v1 pack's data batches, exactly as v1 wrote them (frozen)."""

def decode_v1_columns(cols: dict, n: int) -> dict:
    """A v1 index's columns as record schema v1 field columns (``n`` records)."""
    shards = cols["shard"]
    stats = cols["stats"]
    out = {name: cols[name] for name in (
        "model_id", "run_id", "request_id", "hook", "layer", "start_token", "n_tokens", "step", "phase",
        "shard_rank", "tp_size", "dtype", "shape", "codec", "raw_size", "checksum",
    )}
    out["shard_axis"] = [-1 if s is None else s[0] for s in shards]
    out["shard_offset"] = [0 if s is None else s[1] for s in shards]
    out["full_shape"] = [[] if s is None else s[2] for s in shards]
    for i, name in enumerate(("l2_norm", "mean", "absmax")):
        out[name] = [None if s is None else s[i] for s in stats]
    out["payload_offset"] = cols["offset"]
    out["payload_length"] = cols["length"]
    if any(len(column) != n for column in out.values()):
        raise ValueError(f"index columns do not all hold {n} records")
    return out
