"""Tensor parallelism in one process: the per-hook layout, who writes replicated hooks, the
DP/PP ranks, the reader's merge and its missing-rank error, and the catalog upgrade to the
v3 record columns. (Two real ranks are in tests/test_tp_capture.py.)"""

from __future__ import annotations

import pytest
import torch

from dmi.capture import TPReplicated, TPShard, attach, resolve_parallel_ranks
from dmi.capture._hooks import ModelGeometry
from dmi.capture._tp import _flat_dp_rank, _mesh_coordinates
from dmi.capture._tp_layout import TPLayout, emitted_hooks
from dmi.capture._tp_load import replicated_kv_plan
from dmi.reader import assemble
from dmi.storage import RecordEntry, RecordKey, RecordMeta, ShardGeometry
from dmi.storage.errors import (
    AttachError,
    CaptureError,
    DuplicateChunkError,
    InvalidArgumentError,
    MissingShardError,
    ShardMergeError,
)
from dmi.storage.records import ByteRange
from tests._models import MemoryWriter, left_padded_batch, tiny

G = ModelGeometry("llama", n_layers=2, hidden=32, n_heads=4, n_kv_heads=1, head_dim=8, intermediate=50,
                  vocab=97, dtype=torch.float32)


# ------------------------------------------------------------------------------ layout


def test_catalogue_layout_cuts_contiguous_blocks_as_torch_chunk_does():
    assert TPLayout(G, 1, 2).shard("attn_q", (5, 2, 8)) == ShardGeometry(1, 2, (5, 4, 8))
    # 50 features on 4 ranks: blocks of 13, the last rank holds 11 from offset 39
    assert TPLayout(G, 3, 4).shard("mlp_post", (5, 11)) == ShardGeometry(1, 39, (5, 50))
    assert TPLayout(G, 1, 2).shard("attn_pattern", (2, 5, 7)) == ShardGeometry(0, 2, (4, 5, 7))


def test_replicated_hooks_and_gqa_kv_carry_no_geometry():
    layout = TPLayout(G, 1, 2)
    assert layout.shard("resid_post", (5, 32)) is None and layout.replicated("logits")
    assert layout.replicated("attn_k") and layout.shard("attn_k", (5, 1, 8)) is None  # 1 kv head, 2 ranks
    assert not TPLayout(G, 0, 1).shard("attn_q", (5, 4, 8))  # not sharded at all


def test_a_record_that_does_not_fit_the_layout_is_refused():
    """An unsharded q (4 heads) recorded as rank 1 of 2 would claim heads 2..6 of 4."""
    with pytest.raises(CaptureError, match=r"attn_q.*TP rank 1.*\(5, 4, 8\).*tp_layout="):
        TPLayout(G, 1, 2).shard("attn_q", (5, 4, 8))


G_KV2 = ModelGeometry("llama", n_layers=2, hidden=32, n_heads=8, n_kv_heads=2, head_dim=8, intermediate=50,
                      vocab=97, dtype=torch.float32)


def test_a_replicated_record_narrower_than_the_whole_tensor_is_refused():
    """2 kv heads on 4 ranks: the catalogue calls attn_k replicated, but vLLM gives each rank
    one head; a (5, 1, 8) record must not be stored as the whole (5, 2, 8) tensor."""
    layout = TPLayout(G_KV2, 0, 4)
    assert layout.replicated("attn_k") and layout.shard("attn_k", (5, 2, 8)) is None  # whole: kept
    with pytest.raises(CaptureError, match=r"attn_k.*TP rank 0 of 4.*\(5, 2, 8\).*\(5, 1, 8\)"):
        layout.shard("attn_k", (5, 1, 8))
    with pytest.raises(CaptureError, match=r"resid_post.*\(5, 32\).*\(5, 16\)"):
        layout.shard("resid_post", (5, 16))
    assert TPLayout(G_KV2, 0, 1).shard("attn_k", (5, 1, 8)) is None  # no tensor parallelism: nothing to check


def test_vllm_refuses_kv_hooks_when_kv_heads_are_split_between_fewer_ranks():
    from dmi.capture._vllm import _refuse_split_kv_heads
    from dmi.storage.errors import HookSelectionError

    with pytest.raises(HookSelectionError, match=r"attn_k and attn_v .* 2 key/value heads .* 4 tensor-parallel"
                                                 r".*tensor_parallel_size <= 2"):
        _refuse_split_kv_heads({"attn_k": (0,), "attn_v": (0,), "attn_q": (0,)}, G_KV2, 4)
    with pytest.raises(HookSelectionError, match=r"^attn_v cannot"):
        _refuse_split_kv_heads({"attn_v": (0,)}, G_KV2, 4)
    # what vLLM shards or replicates exactly is allowed
    assert _refuse_split_kv_heads({"attn_k": (0,), "attn_v": (0,)}, G_KV2, 2) is None  # one head per rank
    assert _refuse_split_kv_heads({"attn_k": (0,)}, G, 4) is None  # one kv head, copied on every rank
    assert _refuse_split_kv_heads({"attn_q": (0,), "resid_post": (0,)}, G_KV2, 4) is None


def test_hand_made_layout_overrides_the_catalogue():
    layout = TPLayout(G, 1, 2, {"attn_q": TPShard(axis=1, offset=3, full=4), "mlp_post": TPReplicated()})
    assert layout.shard("attn_q", (5, 1, 8)) == ShardGeometry(1, 3, (5, 4, 8))
    assert layout.replicated("mlp_post") and layout.shard("mlp_post", (5, 50)) is None
    assert not layout.replicated("attn_z")  # not named: the catalogue's rule


@pytest.mark.parametrize("said, match", [
    ({"no_such_hook": TPReplicated()}, "unknown hook"),
    ({"attn_q": TPShard(axis=0, offset=0, full=4)}, "not a feature axis"),
    ({"attn_q": TPShard(axis=3, offset=0, full=4)}, "not a feature axis"),
    ({"attn_q": TPShard(axis=1, offset=4, full=4)}, "0 <= offset < full"),
    ({"attn_q": TPShard(axis=1, offset=1.5, full=4)}, "must be ints"),
    ({"attn_q": (1, 0, 4)}, "TPShard"),
])
def test_hand_made_layout_is_checked_where_it_enters(said, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TPLayout(G, 0, 2, said)


def test_only_tp_rank_0_writes_replicated_hooks_unless_all_copies_are_asked_for():
    selected = {"resid_pre": (0, 1), "attn_q": (0,), "attn_k": (1,), "logits": (-1,)}
    assert emitted_hooks(selected, TPLayout(G, 1, 2), "rank0") == {"attn_q": (0,)}
    assert emitted_hooks(selected, TPLayout(G, 0, 2), "rank0") == selected
    assert emitted_hooks(selected, TPLayout(G, 1, 2), "all") == selected
    with pytest.raises(InvalidArgumentError, match="tp_replicas"):
        emitted_hooks(selected, TPLayout(G, 1, 2), "every")


def test_gqa_kv_replicate_plan_only_when_kv_heads_are_fewer_than_ranks():
    class Config:
        num_attention_heads = 4
        num_key_value_heads = 1

    assert set(replicated_kv_plan(Config, 2).values()) == {"replicate"}
    assert replicated_kv_plan(Config, 1) is None


# ------------------------------------------------------------------------------ attach


def _records(tp_rank, **options):
    model = tiny("llama")
    writer = MemoryWriter()
    ids, mask = left_padded_batch()
    with attach(model, hooks=["resid_pre", "token_ids", "logits"], writer=writer, tp_rank=tp_rank, tp_size=2,
                **options) as cap:
        cap.forward(ids, attention_mask=mask)
    return writer.records


def test_attach_on_rank_1_writes_no_replicated_copy_by_default():
    assert _records(1) == []
    keys = [k for k, _, _ in _records(1, tp_replicas="all", dp_rank=3, pp_rank=1)]
    assert {k.hook for k in keys} == {"resid_pre", "token_ids", "logits"}
    assert {(k.shard_rank, k.tp_size, k.dp_rank, k.pp_rank) for k in keys} == {(1, 2, 3, 1)}
    assert {k.hook for k, _, _ in _records(0)} == {"resid_pre", "token_ids", "logits"}


def test_an_unsharded_model_captured_as_rank_1_is_refused_not_mislabelled():
    """Refused at attach, before the model runs (``check_model_cut``; the drain's own check of
    each record's shape is what stops a cut no weight shows: ``test_tp_attach_mismatch.py``)."""
    model = tiny("llama")
    with pytest.raises(AttachError, match=r"^hook 'attn_q': layer 0's self_attn.q_proj holds 32 of the model's 32 "
                                          r"features, where TP rank 1 of 2 expects 16: the model is not sharded"):
        with attach(model, hooks="attn_q", writer=MemoryWriter(), tp_rank=1, tp_size=2):
            pass


# ------------------------------------------------------------------------------ DP / PP ranks


class _NamedMesh:
    """Stands in for a 4-D named DeviceMesh (a real one needs pp*dp*fsdp*tp processes)."""

    mesh_dim_names = ("pp", "dp_replicate", "fsdp", "tp")

    def __init__(self, coordinate, sizes):
        self._coordinate, self._sizes = coordinate, sizes

    def get_coordinate(self):
        return self._coordinate

    def size(self, dim):
        return self._sizes[dim]


def test_ranks_from_a_real_named_mesh(tmp_path):
    """A real 4-D DeviceMesh as transformers builds it (world size 1: every coordinate 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = tiny("gpt2")
        model._device_mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
        assert _mesh_coordinates(model) == {"pp": (0, 1), "dp_replicate": (0, 1), "fsdp": (0, 1), "tp": (0, 1)}
        ranks = resolve_parallel_ranks(model)
        assert (ranks.tp_rank, ranks.tp_size, ranks.dp_rank, ranks.pp_rank) == (0, 1, 0, 0)
    finally:
        dist.destroy_process_group()


def test_dp_and_pp_ranks_come_from_the_mesh_coordinates():
    model = tiny("gpt2")
    model._device_mesh = _NamedMesh([1, 1, 0, 1], [2, 2, 2, 2])
    coords = _mesh_coordinates(model)
    assert coords == {"pp": (1, 2), "dp_replicate": (1, 2), "fsdp": (0, 2), "tp": (1, 2)}
    assert _flat_dp_rank(coords) == 2  # replica 1 of 2, fsdp shard 0 of 2
    ranks = resolve_parallel_ranks(model, tp_rank=1, tp_size=2)
    assert (ranks.tp_rank, ranks.tp_size, ranks.dp_rank, ranks.pp_rank) == (1, 2, 2, 1)
    assert resolve_parallel_ranks(model, tp_rank=1, tp_size=2, dp_rank=0, pp_rank=0).dp_rank == 0
    with pytest.raises(InvalidArgumentError, match="dp_rank"):
        resolve_parallel_ranks(model, tp_rank=0, tp_size=1, dp_rank=-1)


# ------------------------------------------------------------------------------ reader

FULL = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # [layers, tokens, features]


def _rec(rank, *, tp=2, shard=True, layer=0, run="r", dp=0, width=2):
    key = RecordKey("m", run, "q", "mlp_post", layer, 0, 3, shard_rank=rank, tp_size=tp, dp_rank=dp)
    geom = ShardGeometry(1, rank * width, (3, 4)) if shard else None
    shape = (3, width if shard else 4)
    meta = RecordMeta(key, "float32", shape, "raw", 4 * 3 * shape[1], 0, shard=geom)
    return RecordEntry(meta, "p" * 32, ByteRange(0, 0))


def _slice(rank, layer=0):
    return FULL[layer, :, rank * 2 : rank * 2 + 2]


def test_shards_merge_by_default_and_one_rank_reads_its_slice():
    entries = [_rec(1), _rec(0), _rec(0, layer=1), _rec(1, layer=1)]
    tensors = [_slice(1), _slice(0), _slice(0, 1), _slice(1, 1)]
    assert torch.equal(assemble(entries, tensors), FULL)
    assert torch.equal(assemble(entries, tensors, shard_rank=1), FULL[:, :, 2:])


def test_a_missing_rank_is_named_never_a_narrower_tensor():
    with pytest.raises(MissingShardError, match=r"TP rank\(s\) \[1\] of 2 are missing \(present: \[0\]\)") as info:
        assemble([_rec(0), _rec(0, layer=1), _rec(1, layer=1)], [_slice(0), _slice(0, 1), _slice(1, 1)])
    assert (info.value.present, info.value.missing) == ((0,), (1,))
    assert "dmi recover" in str(info.value)
    with pytest.raises(MissingShardError, match=r"\[0, 2\] of 3"):
        assemble([_rec(1, tp=3)], [_slice(1)])


def test_shards_and_replicas_of_one_chunk_do_not_mix():
    with pytest.raises(ShardMergeError, match=r"ranks \[1\] recorded no shard geometry"):
        assemble([_rec(0), _rec(1, shard=False)], [_slice(0), FULL[0]])


def test_two_dp_replicas_are_duplicates_not_shards():
    entries = [_rec(0), _rec(1), _rec(0, dp=1), _rec(1, dp=1)]
    with pytest.raises(DuplicateChunkError, match=r"data/pipeline-parallel ranks \[\(0, 0\), \(1, 0\)\]"):
        assemble(entries, [_slice(0), _slice(1), _slice(0), _slice(1)])


# ------------------------------------------------------------------------------ catalog v2 -> v3


def test_a_schema_2_catalog_gains_the_parallel_rank_columns(tmp_path):
    """Tables as version 2 left them (no dp_rank/pp_rank nor later columns, version row 2) open
    as the current version, and their rows read with rank 0."""
    import pyarrow as pa

    from dmi.catalog import open_catalog
    from dmi.catalog import _schema
    from dmi.storage.record_schema import RECORD_FIELDS
    from tests.catalog_conformance import pack

    uri = f"chdb://{tmp_path / 'cat'}"
    with open_catalog(uri) as catalog:
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1")])
        t = catalog.tables
        later = [f"ALTER TABLE {t['records']} DROP COLUMN {f.name}" for f in RECORD_FIELDS if f.since > 2]
        for statement in (f"DROP TABLE {t['records_published']}", f"DROP TABLE {t['schema']}", *later):
            catalog._backend.command(statement)
        catalog._backend.command(_schema.ddl_statements(t)[0])
        catalog._backend.insert(t["schema"], pa.table({"version": pa.array([2], pa.uint32()), "written_at": [0.0],
                                                       "written_by": ["dmi 2"]}))
        assert catalog.schema_version() == 2
    with open_catalog(uri) as upgraded:
        assert upgraded.schema_version() == _schema.SCHEMA_VERSION
        found = upgraded.find_records("gpt2", run_id="r1")
        assert len(found) == 3 and {(e.meta.key.dp_rank, e.meta.key.pp_rank) for e in found} == {(0, 0)}
        columns = upgraded.sql(f"SELECT dp_rank, pp_rank FROM {upgraded.tables['records_published']}")
        assert columns.num_rows == 3
