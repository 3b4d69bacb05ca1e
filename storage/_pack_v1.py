"""Reading format v1 packs: their row schema, and their index in today's field columns.

Format v1 (the first release) named three fields differently in its rows
(``shard_full_shape``, ``stat_*``), stored a missing shard axis as null, nested shard and
statistics in its index, and recorded no token layout. Its one hook whose tokens were not
on axis 0 was ``attn_pattern`` (``[heads, q_tokens, kv_tokens]``): the legacy rule below
(the same as the catalog's upgrade expression in :data:`RECORD_FIELDS`) supplies the
layout v1 left out. Nothing here is used to write.
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

_LEGACY_PATTERN_HOOK = "attn_pattern"


def decode_v1_columns(cols: dict, n: int) -> dict:
    """A v1 index's columns as today's record field columns (``n`` records)."""
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
    patterns = [hook == _LEGACY_PATTERN_HOOK for hook in cols["hook"]]
    out["token_axis"] = [1 if p else 0 for p in patterns]
    out["key_axis"] = [2 if p else -1 for p in patterns]
    out["payload_offset"] = cols["offset"]
    out["payload_length"] = cols["length"]
    if any(len(column) != n for column in out.values()):
        raise ValueError(f"index columns do not all hold {n} records")
    return out
