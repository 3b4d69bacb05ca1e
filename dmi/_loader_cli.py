"""``dmi export``: a training-loader selection written as shard files, from the command line.

The command's flags become ``Store.loader`` arguments (the same selection, row and shuffle
options the Python loader takes); ``--layers`` follows the one layer rule of the other
commands, resolved against the layers the store holds for the selection (a layer that is
not held is an error naming the held ones, never a silently smaller export); the epoch is
written by :func:`dmi._loader_export.export_epoch`, so the files are what
``loader.export()`` writes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dmi.storage.errors import HookSelectionError, InvalidArgumentError, RecordNotFoundError

__all__ = ["ExportSummary", "parse_params", "run_export"]


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What ``dmi export`` wrote: where, how much, and what ``--on-error skip`` (``skipped_rows``,
    ``damaged_records``) and ``--drop-last`` (``dropped_rows``) left out."""

    directory: str
    manifest: str
    features: tuple[str, ...]
    dtype: str
    epoch: int
    rows: int
    shards: int
    bytes: int
    skipped_rows: int
    damaged_records: tuple[str, ...]
    dropped_rows: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_export(store: Any, args: argparse.Namespace, *, layers: Any,
               progress: Callable[[int], Any]) -> ExportSummary:
    """Build the loader ``args`` describe (``layers``: ``--layers`` as parsed), write its epoch
    ``args.epoch`` under ``args.output``; ``progress(total_batches)`` is a context manager
    whose ``update()`` is called per shard."""
    hooks = _names(args.hooks)
    loader = store.loader(args.model_id, hooks=hooks, layers=_resolve_layers(store, args, hooks, layers),
                          runs=_names(args.runs), phases=_names(args.phases), where=args.where,
                          params=parse_params(args.param), **_row_options(args))
    loader.set_epoch(args.epoch)
    with progress(len(loader)) as bar:
        manifest_path = loader.export(args.output, suffix="." + args.format, on_shard=lambda shard: bar.update())
    manifest = json.loads(manifest_path.read_text())
    return ExportSummary(str(Path(args.output)), str(manifest_path), tuple(manifest["features"]), manifest["dtype"],
                         manifest["epoch"], manifest["rows"], len(manifest["shards"]),
                         sum(s["bytes"] for s in manifest["shards"]), manifest["skipped_rows"],
                         tuple(manifest["damaged_records"]), manifest["dropped_rows"])


def _row_options(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    return {"batch_size": args.batch_size, "dtype": None if args.dtype == "stored" else getattr(torch, args.dtype),
            "shuffle": not args.no_shuffle, "seed": args.seed, "shuffle_buffer": args.shuffle_buffer,
            "layout": args.layout, "with_tokens": args.with_tokens, "normalize": args.normalize,
            "drop_last": args.drop_last, "on_error": args.on_error, "rank": args.rank,
            "world_size": args.world_size}


def _names(text: str | None) -> tuple[str, ...] | None:
    """``"a,b"`` → ``("a", "b")``; ``None`` stays ``None`` (no narrowing)."""
    return None if text is None else tuple(part.strip() for part in text.split(","))


def parse_params(pairs: list[str] | None) -> dict[str, Any] | None:
    """``--param NAME=VALUE`` (repeatable) → the ``params`` of ``--where``. VALUE is read as
    JSON when it parses (``3``, ``0.5``, ``"7"``, ``["a", "b"]``, a list becoming the tuple
    an ``IN`` takes), else taken as text. A missing ``=`` or a name given twice is refused."""
    if not pairs:
        return None
    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InvalidArgumentError(f"--param {pair!r}: write NAME=VALUE")
        if name in params:
            raise InvalidArgumentError(f"--param {name} given twice")
        params[name] = _param_value(text)
    return params


def _param_value(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return tuple(value) if isinstance(value, list) else value


def _resolve_layers(store: Any, args: argparse.Namespace, hooks: tuple[str, ...],
                    layers: Any) -> tuple[int, ...] | None:
    """``--layers`` by the rule of ``capture``/``get``/``plot`` (``dmi.capture.layer_numbers``),
    against the layers the model holds for the selected hooks, runs and phases: negative numbers
    and open ranges count from the last held layer; a layer that any selected hook does not hold
    is refused, naming each hook's held layers (never a smaller export)."""
    from dmi.capture import layer_numbers
    from dmi.storage.records import GLOBAL_LAYER

    if layers is None:
        return None
    found = _held_layers(store, args.model_id, hooks, _names(args.runs), _names(args.phases))
    global_hooks = [hook for hook in hooks if found.get(hook) == [GLOBAL_LAYER]]
    if global_hooks:
        raise HookSelectionError(f"{', '.join(global_hooks)}: global hooks have no layers; export without --layers")
    held = sorted({layer for hook in hooks for layer in found.get(hook, [])})
    if not held:
        raise RecordNotFoundError(f"model {args.model_id!r} holds no records of {', '.join(hooks)} "
                                  "in the selected runs and phases")
    what = f"model {args.model_id} holds " + ", ".join(f"layers {found.get(hook, [])} of {hook}" for hook in hooks)
    numbers = layer_numbers(layers, held[-1] + 1, what)
    missing = {hook: sorted(set(numbers) - set(found.get(hook, []))) for hook in hooks}
    asked = [f"{gone}" + (f" of {hook}" if len(hooks) > 1 else "") for hook, gone in missing.items() if gone]
    if asked:
        raise RecordNotFoundError(f"{what}; --layers {args.layers} asks for {', '.join(asked)}, "
                                  "which were not captured")
    return numbers


def _held_layers(store: Any, model_id: str, hooks: tuple[str, ...], runs: tuple[str, ...] | None,
                 phases: tuple[str, ...] | None) -> dict[str, list[int]]:
    """Per hook, the sorted distinct layers of the published records of this selection
    (``[-1]``: a global hook); a hook without records is absent."""
    conditions, params = ["model_id = %(model)s"], {"model": model_id}
    for column, values in (("hook", hooks), ("run_id", runs), ("phase", phases)):
        if values is not None:
            conditions.append(f"{column} IN %({column})s")
            params[column] = values
    table = store.catalog.sql(f"SELECT DISTINCT hook, layer FROM {store.tables['records']} "
                              f"WHERE {' AND '.join(conditions)} ORDER BY hook, layer", params)
    held: dict[str, list[int]] = {}
    for row in table.to_pylist():
        held.setdefault(row["hook"], []).append(row["layer"])
    return held
