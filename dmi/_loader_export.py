"""One loader epoch written as shard files, for trainers that want files rather than a loader.

Each batch becomes one shard (``shard-00000.safetensors``, ``.npy`` or ``.pt``, written by
:func:`dmi._export.export_tensor`, which never converts a dtype silently); with
``with_tokens=True`` a ``tokens.parquet`` index names each row's (run, request, position);
``manifest.json`` records the selection's features, dtype, order (``from_epoch_start``: false
when the loader was mid-epoch, so the shards hold the epoch's remaining batches), shard list
and what ``on_error="skip"`` (``skipped_rows``, ``damaged_records``) and ``drop_last``
(``dropped_rows``) left out, and where the values came from: per feature, the codecs its
records are stored with and the worst error a lossy one measured at capture (``lossy``,
``codecs``), so a trainer knows when the values are decoded approximations. The manifest is
written last: a directory without one holds an export that did not finish. Every file, the
manifest and the index included, is written under a temporary name and renamed into place
when complete (:func:`dmi._export.write_file`), so a full disk leaves no partial file, and
never an empty manifest, and raises ``ExportError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dmi._export import EXPORT_FORMATS, check_format, export_tensor, worst_error, write_file
from dmi.storage import LOSSY_CODECS, torch_dtype
from dmi.storage.errors import InvalidArgumentError

_TOKEN_SCHEMA = pa.schema([("shard", pa.int64()), ("row", pa.int64()), ("run_id", pa.string()),
                           ("request_id", pa.string()), ("position", pa.int64())])
"""``tokens.parquet``'s columns: fixed, so an index of no rows (``drop_last`` leaving out a
share smaller than a batch) has the types of any other rather than pyarrow's ``null``."""


def export_epoch(loader: Any, directory: str | os.PathLike[str], *, suffix: str = ".safetensors",
                 on_shard: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Write the loader's next epoch under ``directory`` (created; must be empty); returns the
    manifest's path. ``on_shard`` is called with each shard's manifest entry once its file is
    written (progress). Raises ``InvalidArgumentError`` for an unknown suffix, a directory that
    cannot be made or is not empty, or a dtype the format cannot hold exactly (all checked
    before a batch is read), what writing a shard, the token index or the manifest raises
    (``ExportError`` for a full disk), and what iterating the loader raises. An export that
    raises leaves the loader where it stood (position and counts), so no batch is consumed by
    an export that did not finish."""
    if suffix not in EXPORT_FORMATS:
        raise InvalidArgumentError(f"suffix must be one of {', '.join(EXPORT_FORMATS)}, not {suffix!r}")
    check_format(_torch_dtype(loader), suffix)
    root = _empty_directory(Path(directory))
    before = _Position.of(loader)
    path = root / "manifest.json"
    try:
        manifest = _write_shards(loader, root, suffix, on_shard, before)
        text = json.dumps(manifest, indent=1).encode()
        write_file(path, lambda handle: handle.write(text))
    except BaseException:
        before.restore(loader)
        raise
    return path


@dataclass(frozen=True, slots=True)
class _Position:
    """Where a loader stood before an export: its resume state and its counts of what was left out."""

    state: dict[str, Any]
    damaged: int
    skipped: int
    dropped: int

    @classmethod
    def of(cls, loader: Any) -> _Position:
        return cls(loader.state_dict(), len(loader.damaged_records), loader.skipped_rows, loader.dropped_rows)

    @property
    def at_epoch_start(self) -> bool:
        """Whether no batch of the epoch had been consumed: a loader whose iteration was broken
        off continues that epoch, so its export holds only the epoch's remaining batches."""
        return self.state["next"] == 0 and all(cursor == [0, 0] for cursor in self.state["cursors"])

    def restore(self, loader: Any) -> None:
        """Put ``loader`` back here: the next iteration yields the batches the export consumed."""
        loader.load_state_dict(self.state)
        del loader.damaged_records[self.damaged:]
        loader.skipped_rows, loader.dropped_rows = self.skipped, self.dropped


def _write_shards(loader: Any, root: Path, suffix: str, on_shard: Callable[[dict[str, Any]], None] | None,
                  before: _Position) -> dict[str, Any]:
    """One epoch of ``loader`` as shard files (and ``tokens.parquet``) under ``root``; returns
    the manifest. The epoch's iterator is closed before this returns or raises."""
    epoch, shards, rows, index, codecs = loader.epoch, [], 0, [], _feature_codecs(loader.plan)
    batches = iter(loader)
    try:
        for i, batch in enumerate(batches):
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
    finally:
        batches.close()
    if loader.config.with_tokens:
        columns = list(zip(*index)) if index else [[]] * len(_TOKEN_SCHEMA)
        table = pa.table(columns, schema=_TOKEN_SCHEMA)
        write_file(root / "tokens.parquet", lambda handle: pq.write_table(table, handle))
    return {"features": list(loader.features), "dtype": _dtype(loader), "rows": rows,
            "epoch": epoch, "from_epoch_start": before.at_epoch_start, "seed": loader.config.seed,
            "shuffle": loader.config.shuffle,
            "scales": loader.scales, "rank": loader.rank, "world_size": loader.world_size,
            "skipped_rows": loader.skipped_rows - before.skipped,
            "dropped_rows": loader.dropped_rows - before.dropped,
            "damaged_records": loader.damaged_records[before.damaged:],
            "lossy": any(f["lossy"] for f in codecs.values()), "codecs": codecs, "shards": shards}


def _feature_codecs(plan: Any) -> dict[str, dict[str, Any]]:
    """Per feature (by name): the codecs of the selection's records of it, whether any is
    lossy, and the worst error measured when they were written (the catalog's
    ``codec_max_abs_error`` and ``codec_rel_l2_error``, in the captured values' units, before
    any ``dtype`` conversion or ``normalize`` scaling; 0 for lossless codecs). Taken over
    every record of the loader's selection, all ranks' shares included, so it bounds the
    rows of any one export; ``None`` where a record's error is not a number (its values held
    a NaN), which JSON cannot write and no bound can be drawn from."""
    codecs = {}
    for f, feature in enumerate(plan.features):
        metas = [e.meta for unit in plan.units for e in unit.records[f]]
        names = sorted({m.codec for m in metas})
        codecs[feature.name] = {"codecs": names, "lossy": any(name in LOSSY_CODECS for name in names),
                                "max_abs_error": worst_error(m.codec_max_abs_error for m in metas),
                                "rel_l2_error": worst_error(m.codec_rel_l2_error for m in metas)}
    return codecs


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
    """The manifest's ``dtype``: the batches' torch dtype as ``str`` writes it (``torch.float32``),
    the same spelling whether it was asked for or kept as stored (``dtype=None``)."""
    return str(_torch_dtype(loader))


def _torch_dtype(loader: Any) -> torch.dtype:
    """The dtype of the loader's batches (``dtype=None``: the stored one, one for every feature)."""
    fmt = loader.config.fmt
    return fmt.dtype if fmt.dtype is not None else torch_dtype(loader.plan.features[0].dtype)
