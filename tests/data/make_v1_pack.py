"""Write ``tests/data/pack_v1/``: one pack in format v1, and the tensors it holds.

Run once, with the code of commit a36b4a9 (the last one that wrote format v1), from the
repository root::

    python tests/data/make_v1_pack.py

It writes ``pack_v1/<pack id>.arrow`` (the pack) and ``pack_v1/expected.pt`` (a dict:
``records`` = list of (key fields, tensor, shard geometry or None) in append order).
``tests/test_pack_compat.py`` reads the pack with today's code and compares bit for bit.
The pack is committed; do not regenerate it with a newer writer (it would stop being v1).
"""

from __future__ import annotations

import pathlib
import shutil

import torch

from dmi.storage import PackStore, PackWriter, RecordKey, ShardGeometry

HERE = pathlib.Path(__file__).resolve().parent / "pack_v1"


def _records() -> list[tuple[RecordKey, torch.Tensor, ShardGeometry | None]]:
    g = torch.Generator().manual_seed(9)
    key = lambda hook, layer, start, n, **kw: RecordKey("tiny", "run-v1", "req-0", hook, layer, start, n, **kw)  # noqa: E731
    pattern = torch.softmax(torch.randn(2, 5, 5, generator=g), dim=-1).tril().to(torch.float16)
    return [
        (key("token_ids", -1, 0, 5, phase="prefill"), torch.arange(100, 105, dtype=torch.int64), None),
        (key("resid_post", 0, 0, 5, phase="prefill"), torch.randn(5, 8, generator=g), None),
        (key("resid_post", 0, 5, 1, step=1, phase="decode"), torch.randn(1, 8, generator=g), None),
        (key("attn_q", 1, 0, 5, phase="prefill", shard_rank=1, tp_size=2),
         torch.randn(5, 2, 4, generator=g).to(torch.bfloat16), ShardGeometry(1, 2, (5, 4, 4))),
        (key("attn_pattern", 0, 0, 5, phase="prefill"), pattern, None),
        (key("attn_pattern", 0, 5, 1, step=1, phase="decode"),
         torch.softmax(torch.randn(2, 1, 6, generator=g), dim=-1).to(torch.float16), None),
        (key("router_topk", 0, 0, 5, phase="prefill"), torch.randint(0, 4, (5, 2), generator=g), None),
        (key("mlp_post", 1, 0, 0, phase="prefill"), torch.empty(0, 16, dtype=torch.float32), None),
    ]


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    HERE.mkdir(parents=True)
    records = _records()
    with PackWriter(PackStore.local(HERE), writer_id="w-fixture-v1", codec="split-zstd") as writer:
        for key, tensor, shard in records:
            writer.append(key, tensor, shard=shard)
    expected = [
        ({f: getattr(k, f) for f in RecordKey.__slots__}, t,
         None if s is None else (s.axis, s.offset, list(s.full_shape)))
        for k, t, s in records
    ]
    torch.save({"records": expected}, HERE / "expected.pt")


if __name__ == "__main__":
    main()
