"""Exported files read back with their own libraries, value by value against ``store.get_internal``.

One store (real packs from a PackWriter, published into a real chDB catalog) holds five models
of two hooks x two layers: bfloat16, float16, float32, and the lossy ``fp8`` (float32) and
``int8`` (bfloat16) codecs, whose export carries the decoded values ``get_internal`` gives.
Request ids hold quotes, ``%``, ``/``, spaces and non-ASCII letters. Each export is loaded with
``safetensors.torch.load_file``, ``numpy.load`` or ``torch.load`` and ``pyarrow.parquet``, and
every row must be its token's row, every token exactly once.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import dmi
from dmi._export import export_tensor
from dmi.storage import PackWriter
from dmi.storage.records import RecordKey

D = 4
REQUESTS = (("a/b c", 3), ("\u00fc'\"%x", 4), ("q 2;--", 2), ("plain", 5))
MODELS = {"bf16": (torch.bfloat16, None), "f16": (torch.float16, None), "f32": (torch.float32, None),
          "fp8": (torch.float32, "fp8"), "int8": (torch.bfloat16, "int8")}
"""Model id: (stored dtype, codec; ``None``: the writer's lossless default)."""
FEATURES = ["resid_post.0", "resid_post.1", "attn_out.0", "attn_out.1"]
TOKENS = {("run", request, p) for request, n in REQUESTS for p in range(n)}


def _values(*parts, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))
    return torch.randn(n, D, generator=g).to(dtype)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with dmi.open(home=tmp_path_factory.mktemp("export-roundtrip")) as opened:
        descriptors = []
        with PackWriter(opened.packs, max_records=5, on_seal=descriptors.append) as writer:
            for model, (dtype, codec) in MODELS.items():
                for request, n in REQUESTS:
                    for hook in ("resid_post", "attn_out"):
                        for layer in range(2):
                            key = RecordKey(model, "run", request, hook, layer, 0, n, phase="prefill")
                            writer.append(key, _values(model, request, hook, layer, n=n, dtype=dtype), codec=codec)
            for rank in range(2):
                key = RecordKey("tp", "run", "s", "resid_post", 0, 0, 3, phase="forward", shard_rank=rank, tp_size=2)
                writer.append(key, torch.full((3, D), float(rank + 1)))
        with opened.catalog.publisher("export-roundtrip") as publisher:
            publisher.publish(descriptors)
        yield opened


def _load(path: Path) -> torch.Tensor:
    if path.suffix == ".safetensors":
        return load_file(path)["x"]
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path, allow_pickle=False))
    return torch.load(path)


def _read(out: Path) -> tuple[dict, list[torch.Tensor], list[dict]]:
    """The manifest, the shards' rows in order, and ``tokens.parquet``'s rows."""
    manifest = json.loads((out / "manifest.json").read_text())
    rows = [row for shard in manifest["shards"] for row in _load(out / shard["file"])]
    return manifest, rows, pq.read_table(out / "tokens.parquet").to_pylist()


EXPORTS = [pytest.param(model, dtype, suffix, id=f"{model}-{'stored' if dtype is None else 'float32'}-{suffix[1:]}")
           for suffix in (".safetensors", ".npy", ".pt") for dtype in (None, torch.float32) for model in MODELS
           if not (suffix == ".npy" and (MODELS[model][0] if dtype is None else dtype) == torch.bfloat16)]
"""Every stored kind, as stored and as float32, in every format — but bfloat16 in ``.npy``,
which numpy cannot hold and the export refuses (tests/test_cli_export.py)."""


@pytest.mark.parametrize(("model", "dtype", "suffix"), EXPORTS)
def test_every_token_once_bit_exact_with_its_token_and_features(store, tmp_path, model, dtype, suffix):
    out_dtype = MODELS[model][0] if dtype is None else dtype
    loader = store.loader(model, hooks=["resid_post", "attn_out"], layers=[0, 1], batch_size=3, dtype=dtype,
                          with_tokens=True, seed=5)
    manifest, rows, index = _read(Path(loader.export(tmp_path / "out", suffix=suffix)).parent)
    assert manifest["features"] == FEATURES and manifest["dtype"] == str(out_dtype) and manifest["rows"] == 14
    assert [(t["shard"], t["row"]) for t in index] == [(s, r) for s, shard in enumerate(manifest["shards"])
                                                      for r in range(shard["rows"])]
    assert sorted((t["run_id"], t["request_id"], t["position"]) for t in index) == sorted(TOKENS)
    for row, token in zip(rows, index, strict=True):
        assert row.dtype == out_dtype and row.shape == (4, D)
        for f, feature in enumerate(FEATURES):
            hook, layer = feature.split(".")
            want = store.get_internal(model, token["request_id"], hook, layers=int(layer))[0][token["position"]]
            assert torch.equal(row[f], want.to(out_dtype))


@pytest.mark.parametrize("layout", ["stack", "concat"])
def test_a_pt_shard_holds_only_its_own_rows(store, tmp_path, layout):
    # the last batch (14 = 4 x 3 + 2 rows) is shorter: its file must not carry the batch buffer's other rows
    loader = store.loader("f32", hooks=["resid_post", "attn_out"], layers=[0], batch_size=3, shuffle=False,
                          layout=layout)
    manifest = json.loads(Path(loader.export(tmp_path / "out", suffix=".pt")).read_text())
    assert [s["rows"] for s in manifest["shards"]] == [3, 3, 3, 3, 2]
    for shard in manifest["shards"]:
        x = torch.load(tmp_path / "out" / shard["file"])
        assert x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.nbytes == shard["rows"] * 2 * D * 4


def test_a_view_written_as_pt_holds_its_values_only(tmp_path):
    whole = torch.arange(100, dtype=torch.float32)
    export_tensor(whole[10:12], tmp_path / "v.pt", name="x")
    x = torch.load(tmp_path / "v.pt")
    assert x.tolist() == [10.0, 11.0] and bytes(x.untyped_storage()) == whole[10:12].numpy().tobytes()


def test_an_index_of_no_rows_has_the_columns_types(store, tmp_path):
    # 14 tokens, batches of 64 and drop_last: no batch, every row dropped
    loader = store.loader("f32", layers=[0], batch_size=64, drop_last=True, with_tokens=True)
    manifest, rows, index = _read(Path(loader.export(tmp_path / "empty")).parent)
    assert (manifest["rows"], manifest["dropped_rows"], manifest["shards"], rows, index) == (0, 14, [], [], [])
    full = store.loader("f32", layers=[0], batch_size=64, with_tokens=True)
    full.export(tmp_path / "full")
    empty_schema = pq.read_schema(tmp_path / "empty" / "tokens.parquet").remove_metadata()
    assert empty_schema == pq.read_schema(tmp_path / "full" / "tokens.parquet").remove_metadata()
    assert [str(t) for t in empty_schema.types] == ["int64", "int64", "string", "string", "int64"]


def test_a_filter_on_an_odd_request_id_and_ranks_shares(store, tmp_path):
    odd = "\u00fc'\"%x"
    loader = store.loader("bf16", layers=[1], batch_size=2, dtype=None, with_tokens=True,
                          where="request_id = %(r)s", params={"r": odd})
    manifest, rows, index = _read(Path(loader.export(tmp_path / "odd")).parent)
    assert sorted(t["position"] for t in index) == [0, 1, 2, 3] and {t["request_id"] for t in index} == {odd}
    want = store.get_internal("bf16", odd, "resid_post", layers=1)[0]
    assert all(torch.equal(row, want[t["position"]]) for row, t in zip(rows, index, strict=True))
    shares = []
    for rank in range(3):
        share = store.loader("f16", layers=[0], batch_size=2, dtype=None, with_tokens=True, rank=rank, world_size=3)
        shares += _read(Path(share.export(tmp_path / f"rank{rank}", suffix=".npy")).parent)[2]
    assert sorted((t["run_id"], t["request_id"], t["position"]) for t in shares) == sorted(TOKENS)


@pytest.mark.parametrize("rank", [0, 1])
def test_one_tensor_parallel_rank_s_records(store, tmp_path, rank):
    loader = store.loader("tp", layers=[0], where="shard_rank = %(r)s", params={"r": rank}, shuffle=False)
    out = Path(loader.export(tmp_path / "tp", suffix=".safetensors")).parent
    x = load_file(out / "shard-00000.safetensors")["x"]
    assert torch.equal(x, store.get_internal("tp", "s", "resid_post", layers=0, shard_rank=rank)[0])


def test_a_loader_broken_off_mid_epoch_exports_the_rest_and_says_so(store, tmp_path):
    loader = store.loader("f32", layers=[0], batch_size=4, with_tokens=True, seed=1)
    batches = iter(loader)
    _, first = next(batches)
    batches.close()
    manifest, _, index = _read(Path(loader.export(tmp_path / "rest")).parent)
    assert (manifest["epoch"], manifest["from_epoch_start"], manifest["rows"]) == (0, False, 10)
    rest = [(t["run_id"], t["request_id"], t["position"]) for t in index]
    assert sorted(list(first) + rest) == sorted(TOKENS)
    manifest = json.loads(Path(loader.export(tmp_path / "next")).read_text())
    assert (manifest["epoch"], manifest["from_epoch_start"], manifest["rows"]) == (1, True, 14)
