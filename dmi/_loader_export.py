"""One loader epoch written as shard files, for trainers that want files rather than a loader.

Each batch becomes one shard (``shard-00000.safetensors``, ``.npy`` or ``.pt``, written by
:func:`dmi._export.export_tensor`, which never converts a dtype silently); with
``with_tokens=True`` a ``tokens.parquet`` index names each row's (run, request, position);
``manifest.json`` records the selection's features, dtype, order, shard list and what
``on_error="skip"`` left out. The manifest is written last: a directory without one holds
an export that did not finish.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dmi._export import EXPORT_FORMATS, export_tensor
from dmi.storage.errors import InvalidArgumentError


def export_epoch(loader: Any, directory: str | os.PathLike[str], *, suffix: str = ".safetensors",
                 on_shard: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Write the loader's next epoch under ``directory`` (created; must be empty); returns the
    manifest's path. ``on_shard`` is called with each shard's manifest entry once its file is
    written (progress). Raises ``InvalidArgumentError`` for an unknown suffix, a directory that
    cannot be made or is not empty, or a dtype the format cannot hold exactly, and what
    iterating the loader raises."""
    if suffix not in EXPORT_FORMATS:
        raise InvalidArgumentError(f"suffix must be one of {', '.join(EXPORT_FORMATS)}, not {suffix!r}")
    root = _empty_directory(Path(directory))
    epoch, shards, rows, index = loader.epoch, [], 0, []
    damaged_before, skipped_before = len(loader.damaged_records), loader.skipped_rows
    for i, batch in enumerate(loader):
        x, tokens = batch if loader.config.with_tokens else (batch, None)
        name = f"shard-{i:05d}{suffix}"
        export_tensor(x, root / name, name="x")
        shard = {"file": name, "rows": int(x.shape[0]), "bytes": (root / name).stat().st_size}
        shards.append(shard)
        rows += shard["rows"]
        if tokens is not None:
            index.extend((i, row, *token) for row, token in enumerate(tokens))
        if on_shard is not None:
            on_shard(shard)
    if loader.config.with_tokens:
        columns = list(zip(*index)) if index else [[], [], [], [], []]
        names = ["shard", "row", "run_id", "request_id", "position"]
        pq.write_table(pa.table(dict(zip(names, columns))), root / "tokens.parquet")
    manifest = {"features": list(loader.features), "dtype": _dtype(loader), "rows": rows,
                "epoch": epoch, "seed": loader.config.seed, "shuffle": loader.config.shuffle,
                "scales": loader.scales, "rank": loader.rank, "world_size": loader.world_size,
                "skipped_rows": loader.skipped_rows - skipped_before,
                "damaged_records": loader.damaged_records[damaged_before:], "shards": shards}
    path = root / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _empty_directory(root: Path) -> Path:
    """``root``, created if absent; refused when it cannot be made or already holds files."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot create the export directory {root}: {exc.strerror or exc}") from exc
    if any(root.iterdir()):
        raise InvalidArgumentError(f"{root} is not empty; export into a new directory")
    return root


def _dtype(loader: Any) -> str:
    fmt = loader.config.fmt
    return str(fmt.dtype) if fmt.dtype is not None else loader.plan.features[0].dtype
