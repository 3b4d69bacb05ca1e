"""``dmi.open()`` and the ``Store``: one catalog plus one pack location, read as tensors.

A store pairs the ClickHouse catalog (what exists, where its bytes are) with the pack
store (the bytes). Reads go catalog query → coalesced byte ranges → checksum → decode →
reassembly, and never scan a pack. Summaries (``models``, ``requests``, ``contents``) and
``sql`` read only the index: per-record statistics (L2 norm, mean, absmax) were computed
at write time, so questions about norms need no payload.

Where things live, by precedence (explicit arguments first, then the environment)::

    catalog: catalog=URI  >  home=DIR → DIR/catalog  >  $DMI_CATALOG  >  $DMI_HOME/catalog  >  ~/.local/share/dmi/catalog
    packs:   packs=LOC    >  home=DIR → DIR/packs    >  $DMI_PACKS    >  $DMI_HOME/packs    >  ~/.local/share/dmi/packs
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import threading
import unicodedata
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dmi._home import default_home
from dmi._values import (
    DeleteReport,
    HookSummary,
    Loss,
    ModelSummary,
    PhaseSpan,
    Problem,
    RecoveredPack,
    RequestContents,
    RequestSummary,
    RunSummary,
    VerifyReport,
)
from dmi.catalog import CATALOG_ENV, HOME_ENV, Catalog, default_catalog_uri, open_catalog
from dmi.storage import PackStore
from dmi.storage.errors import (
    DuplicateChunkError,
    HookSelectionError,
    InvalidArgumentError,
    PackError,
    PackNotFoundError,
    RecordNotFoundError,
    ServerError,
)
from dmi.storage.records import GLOBAL_LAYER, HOOK_ORDER, TEXT_HOOKS, RecordEntry

if TYPE_CHECKING:  # torch and the reader's tensor half load on the first tensor read:
    import numpy as np  # listing commands (`dmi models`) never pay for them, nor `dmi show`
    import pyarrow as pa
    import torch

    from dmi._lazy import LazyInternal
    from dmi._tokens import RequestTokens
    from dmi.reader import FooterCache
    from dmi.storage import WholePack

__all__ = ["Store", "open", "capture", "default_home", "PACKS_ENV", "HOME_ENV", "CATALOG_ENV"]

PACKS_ENV = "DMI_PACKS"


def open(catalog: str | None = None, packs: str | None = None, *, home: str | os.PathLike[str] | None = None) -> Store:
    """Open a store: the embedded chDB catalog and a local packs directory by default.

    ``catalog``: ``chdb:///path`` (embedded, shared by processes that take turns) or
    ``clickhouse://user:password@host:port/database`` (a server; ``?cluster=NAME`` for a
    replicated cluster). ``packs``: a directory, ``s3://bucket/prefix`` (sealed by a
    create-if-absent PUT) or another ``pyarrow.fs`` URI (``file:///dir``). ``home``: a
    directory holding both (``home/catalog``, ``home/packs``). See the module docstring
    for the precedence of arguments and environment variables.

    Returns an open :class:`Store`; use it as a context manager or call ``close()``.
    Raises ``CatalogLockedError`` (another process held the chDB directory for one unit of
    work past the wait), ``CatalogReadOnlyError`` (the chDB directory is read-only),
    ``CatalogUnavailableError`` (server unreachable), ``BackendNotInstalledError``,
    ``SchemaVersionError``, ``InvalidArgumentError`` (malformed URI, or a ``catalog``,
    ``packs`` or ``home`` that is empty, not text or holds a control character: refused
    before anything, catalog or packs directory, is created).
    """
    for value, what in ((catalog, "catalog"), (packs, "packs"), (home, "home")):
        _check_location(value, what)
    if home is None:
        home_dir = default_home()
        catalog = catalog or default_catalog_uri()
        packs = packs or os.environ.get(PACKS_ENV) or str(Path(home_dir) / "packs")
    else:  # an explicit home beats the environment
        home_dir = str(Path(home).expanduser().resolve())
        catalog = catalog or "chdb://" + str(Path(home_dir) / "catalog")
        packs = packs or str(Path(home_dir) / "packs")
    opened_catalog, pack_store = _open_parts(catalog, packs)
    store = Store(opened_catalog, pack_store, home=home_dir)
    store._opened_from = (os.fspath(catalog), os.fspath(packs))
    return store


def _check_location(value: Any, what: str) -> None:
    """Refuse a ``catalog``/``packs``/``home`` argument that names no place, before anything
    is created: not a str or path, empty or blank (it used to mean the default, and ``home=""``
    the working directory), a control character (the URI parser drops a newline or tab, so
    another directory was opened) or a NUL, or a lone surrogate. ``None`` means not given."""
    if value is None:
        return
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{what} must be a str or a path, not {type(value).__name__}")
    if not text.strip():
        raise InvalidArgumentError(f"{what} is {text!r}: name a directory or URI, or leave {what} out for the default")
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cs"):
            raise InvalidArgumentError(
                f"{what} {text!r} contains the character U+{ord(char):04X} (a control character or lone "
                "surrogate), which no directory or URI DMI opens may hold; check how the value was built"
            )


def _open_parts(catalog: str | os.PathLike[str], packs: str | os.PathLike[str]) -> tuple[Any, PackStore]:
    """The opened catalog and pack store, in an order that lets a malformed URI of either
    be refused before anything is created.

    Opening a local pack directory creates it, and opening a chDB catalog creates its
    directory, so neither may run before the other URI is known to be good: a remote
    packs URI (``s3://``, another ``pyarrow.fs`` URI, which creates nothing when opened)
    is opened first; a local one (a plain path or ``file://``) is checked first
    (:meth:`PackStore.local_directory`) and its directory created after the catalog opened,
    and a pack store that fails to open then closes the catalog.
    """
    directory = PackStore.local_directory(packs)
    pack_store = PackStore.from_uri(packs) if directory is None else None
    opened = open_catalog(catalog)
    if pack_store is not None:
        return opened, pack_store
    try:
        return opened, PackStore.local(directory)
    except BaseException:
        opened.close()
        raise


class _Default:
    """A keyword's default value, told apart from the same value passed explicitly: with a
    plan, ``capture`` refuses every argument the plan also sets, whatever its value. Its
    repr is the value's, so ``help(dmi.capture)`` shows the real default."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _resolved(value: Any) -> Any:
    """The value an argument stands for: a default's own value, anything else as given."""
    return value.value if isinstance(value, _Default) else value


@contextmanager
def capture(model: Any, *, hooks: Any = _Default("resid_post"), layers: Any = _Default(None),
            store: Store | None = None, plan: Any = None, **options: Any) -> Iterator[Any]:
    """Capture ``model``'s internals into ``store`` (default: ``dmi.open()``, closed on exit;
    for many captures in one process open one store and pass it, since every embedded catalog
    opened after the last was closed starts chDB's server again, which keeps descriptors for
    good) while the block runs.

    Yields the capture session (``dmi.capture.CaptureSession``): call
    ``session.generate(input_ids, attention_mask, **generate_kwargs)`` or
    ``session.forward(...)``; each returns the request ids and the model's own output.
    ``hooks`` are hook names or group tokens (``"resid"``, ``"attn"``, ``"mlp"``,
    ``"logits"``, ``"all"``, ...; default ``"resid_post"``), ``layers`` a range, list, int
    or ``None`` (all, the default).
    ``options`` go to ``dmi.capture.attach`` (``model_id``, ``run_id``, ``schedule``,
    ``ring_slots``, ``drop_policy``, ``tokenizer``, ...); with ``tokenizer=`` each request
    also keeps its prompt text and token strings (``Store.tokens``). On exit every hook is
    removed and every record is sealed and published.

    ``plan``: a capture plan (``dmi.CapturePlan`` or the path of a plan file, see
    ``docs/plans.md``) instead of ``hooks``/``layers``/options: the plan becomes the same
    keyword arguments, its layers are checked against ``model`` first (``PlanError``), and
    its ``store`` section is opened when ``store`` is not given. ``hooks``, ``layers`` or an
    option the plan also sets, passed as well, is refused (``InvalidArgumentError``) even
    when it equals its default: the plan's value is never silently preferred.

    Raises ``HookSelectionError`` (unknown hook or group, empty layer range),
    ``AttachError`` (the model is already attached), ``AttentionImplementationError``,
    ``InvalidIdentifierError``, ``PlanError``, and on exit ``DrainError`` if writing failed.
    """
    from dmi.capture import attach

    if plan is not None:
        plan, options = _plan_options(model, plan, hooks, layers, options)
        hooks, layers = options.pop("hooks"), options.pop("layers")
    else:
        hooks, layers = _resolved(hooks), _resolved(layers)
    own = store is None
    if own and plan is not None and plan.store.given:
        target = open(plan.store.catalog, plan.store.packs, home=plan.store.home)
    else:
        target = open() if own else store
    try:
        with attach(model, hooks=hooks, layers=layers, store=target.packs, catalog=target.catalog,
                    **options) as session:
            yield session
    finally:
        if own:
            target.close()


@contextmanager
def capture_vllm(llm: Any, *, hooks: Any = "resid_post", layers: Any = None, store: Store | None = None,
                 **options: Any) -> Iterator[Any]:
    """Capture the internals of a ``vllm.LLM`` into ``store`` (default: ``dmi.open()``) while the
    block runs. Yields a ``dmi.capture.VLLMCaptureSession``: ``session.generate(prompts,
    sampling_params)`` is ``llm.generate`` with every returned request published, readable by
    the ``request_id`` vLLM returned. ``hooks``/``layers``/``options`` as for
    :func:`capture` (``dmi.capture.attach_vllm``'s keywords). The engine must run eagerly,
    without prefix caching, and in this process unless built with
    ``worker_extension_cls="dmi.vllm.CaptureWorkerExtension"`` (then every worker — each
    tensor-parallel rank — captures in its own process): ``VLLMConfigError`` says what to
    change. See ``docs/vllm.md``."""
    from dmi.capture import attach_vllm, engine_in_this_process

    own = store is None
    target = open() if own else store
    try:
        if hasattr(llm, "llm_engine") and not engine_in_this_process(llm):
            from dmi.vllm import capture_in_workers

            catalog, packs = target._locations_for_another_process()
            attached = capture_in_workers(llm, catalog=catalog, packs=packs,
                                          options={"hooks": hooks, "layers": layers, **options})
        else:
            attached = attach_vllm(llm, hooks=hooks, layers=layers, store=target.packs, catalog=target.catalog,
                                   **options)
        with attached as session:
            yield session
    finally:
        if own:
            target.close()


def _plan_options(model: Any, plan: Any, hooks: Any, layers: Any,
                  options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The plan (loaded if a path) and the keyword arguments it stands for; an argument given
    both in the plan and to ``capture`` is refused rather than silently preferring one. The
    plan always sets ``hooks`` and ``layers``, so either passed explicitly (not left as its
    :class:`_Default`, whatever its value) is refused."""
    from dmi._plan_file import CapturePlan, load_plan
    from dmi.capture import resolve_architecture

    source = os.fspath(plan) if isinstance(plan, (str, os.PathLike)) else "<plan>"
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    if not isinstance(plan, CapturePlan):
        raise InvalidArgumentError(f"plan must be a dmi.CapturePlan or a plan file path, not {type(plan).__name__}")
    given = [name for name, value in (("hooks", hooks), ("layers", layers)) if not isinstance(value, _Default)]
    given += [k for k in options if k in plan.attach_options()]
    if given:
        raise InvalidArgumentError(f"{', '.join(given)} given both by the plan and as arguments; set them in one place")
    plan.check_layers(resolve_architecture(model).n_layers, source)
    return plan, {**plan.attach_options(), **options}


_DEFAULT_TABLE_PREFIX = Catalog.__init__.__kwdefaults__["table_prefix"]  # the tables dmi.open opens


class Store:
    """A catalog and a pack store, read together. Made by :func:`dmi.open`.

    Attributes: ``catalog`` (the ``dmi.catalog.Catalog``), ``packs`` (the
    ``dmi.catalog.PackStore``), ``home``. Thread-safe for reads. Closing closes the catalog.
    """

    def __init__(self, catalog: Any, packs: PackStore, *, home: str | None = None,
                 footer_cache: FooterCache | None = None):
        self.catalog = catalog
        self.packs = packs
        self.home = home if home is not None else default_home()
        self._given_footers = footer_cache
        self._opened_from: tuple[str, str] | None = None  # the URIs dmi.open opened, credentials included
        self._footers_lock = threading.Lock()

    @property
    def _footers(self) -> FooterCache:
        """The footer cache, made on the first read (the reader imports torch)."""
        with self._footers_lock:
            if self._given_footers is None:
                from dmi.reader import FooterCache

                self._given_footers = FooterCache()
            return self._given_footers

    # -------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the catalog (idempotent). Pack files need no closing."""
        self.catalog.close()

    def __repr__(self) -> str:
        return f"<dmi.Store catalog={self.catalog_uri} packs={self.packs_uri}>"

    def _locations_for_another_process(self) -> tuple[str, str]:
        """The catalog and packs URIs another process opens this store by (``dmi.open``): those
        this store was opened from, credentials included (:attr:`catalog_uri` shows none, so a
        server catalog's user and password would be lost). A store made from its parts is
        passed by :attr:`catalog_uri` and :attr:`packs_uri`; one whose catalog has a table prefix
        of its own is refused, as another process would open the default tables."""
        if self._opened_from is not None:
            return self._opened_from
        prefix = getattr(self.catalog, "table_prefix", _DEFAULT_TABLE_PREFIX)
        if prefix != _DEFAULT_TABLE_PREFIX:
            raise InvalidArgumentError(
                f"this store's catalog uses table prefix {prefix!r}, which another process opening "
                f"{self.catalog_uri} would not: capture in vLLM's worker processes needs a store from "
                "dmi.open (the default tables)")
        return self.catalog_uri, self.packs_uri

    @property
    def catalog_uri(self) -> str:
        """Where the catalog is (``chdb:///...`` or ``clickhouse://host:port/db``)."""
        return self.catalog.where

    @property
    def packs_uri(self) -> str:
        """Where the pack files are."""
        return self.packs.uri

    @property
    def tables(self) -> dict[str, str]:
        """Placeholders ``sql`` expands, and the qualified table each stands for."""
        tables = self.catalog.tables
        names = {name: qualified for name, qualified in tables.items() if name != "records_published"}
        names["records_all"] = names.pop("records")
        names["records"] = tables["records_published"]
        return names

    def capture(self, model: Any, **options: Any) -> AbstractContextManager[Any]:
        """Same as ``dmi.capture(model, store=self, **options)``."""
        return capture(model, store=self, **options)

    def capture_vllm(self, llm: Any, **options: Any) -> AbstractContextManager[Any]:
        """Same as ``dmi.capture_vllm(llm, store=self, **options)``."""
        return capture_vllm(llm, store=self, **options)

    # -------------------------------------------------------------------------------- the index
    def sql(self, query: str, params: dict[str, Any] | None = None) -> pa.Table:
        """Run SQL over the index; returns an Arrow table. Reads no payload.

        ``{records}`` expands to the published records (one row per record: key, dtype,
        shape, codec, sizes, pack and byte range, ``l2_norm``/``mean``/``absmax``);
        ``{packs}``, ``{losses}``, ``{watermarks}``, ``{audits}``, ``{records_all}`` (unpublished rows too)
        to the other tables (see ``tables``). Other braces are left alone. Values go in
        ``params``, named in the text as ``%(name)s`` (a literal ``%`` is then written ``%%``):
        the catalog renders each as a literal, so a value never enters the text any other way.
        Raises ``ServerError`` (with ClickHouse's code and name) on a bad query — naming any
        ``{word}`` that is not a table, where the query failed (``{recs}`` for ``{records}``) —,
        ``InvalidArgumentError`` if ``query`` is not a string, ``params`` not a dict, or a
        parameter is missing or has no SQL literal.
        """
        if not isinstance(query, str):
            raise InvalidArgumentError(f"sql() takes a str, not {type(query).__name__}")
        text = query
        for name, qualified in self.tables.items():
            query = query.replace("{" + name + "}", qualified)
        try:
            return self.catalog.sql(query, params)
        except ServerError as exc:
            unknown = sorted(set(_BRACED_WORD.findall(text)) - set(self.tables))
            if exc.code != _SYNTAX_ERROR or not unknown:
                raise
            named = ", ".join("{" + u + "}" for u in unknown)
            raise ServerError(
                f"{named} {'is not a table' if len(unknown) == 1 else 'are not tables'}; the tables are "
                f"{', '.join('{' + t + '}' for t in self.tables)} ({exc})", code=exc.code, name=exc.name,
            ) from exc

    def models(self) -> list[ModelSummary]:
        """Every model id with published records, with run, request, record and byte totals."""
        return [ModelSummary(t.model_id, t.runs, t.requests, t.records, t.stored_bytes, t.raw_bytes)
                for t in self.catalog.model_totals()]

    def runs(self, model_id: str | None = None) -> list[RunSummary]:
        """Every visible run (of ``model_id``), by model then run id, with its capture time
        span, requests, records, packs and bytes. Raises ``RecordNotFoundError`` for an
        unknown model id."""
        rows = self.catalog.run_totals(model_id).to_pylist()
        if model_id is not None and not rows:
            self._diagnose(model_id, None, None)
        return [RunSummary(r["model_id"], r["run_id"], float(r["first_sealed_at"]), float(r["last_sealed_at"]),
                           int(r["requests"]), int(r["records"]), int(r["packs"]), int(r["stored_bytes"]),
                           int(r["raw_bytes"])) for r in rows]

    def delete(self, model_id: str, run_id: str | None = None, *,
               expected: Mapping[str, tuple[int, int]] | None = None) -> DeleteReport:
        """Delete every run of ``model_id`` (or one run): invisible to every reader at once,
        then its pack files removed, except packs another run still has records in. A run that
        holds only losses (capture dropped every record: ``catalog.loss_only_runs``) is deleted
        too: its losses are hidden, and the report counts it with 0 records.

        Crash-safe: the runs vanish all together or not at all, and files go only after
        that; a delete interrupted in between is finished by the next ``delete`` (of any
        model). Deleting what is already deleted returns a report with no runs. Raises
        ``RecordNotFoundError`` for a model or run that never existed.

        ``expected`` (``{run_id: (records, lost)}``: the records of each run, and for a run
        that holds only losses its lost count, as the caller counted them, e.g. to ask a user):
        when the selection holds anything else by the time the runs are hidden (a run published
        since, records dropped since), ``SelectionChangedError`` (an ``InvalidArgumentError``
        whose ``now`` holds what it found) and nothing is deleted.
        """
        finished = self.catalog.purge_deleted(self.packs)
        deletions = self.catalog.delete_runs(model_id, run_id, deleted_by=f"{socket.gethostname()}:{os.getpid()}",
                                             expected=expected)
        if not deletions:
            if not self.catalog.deletions(model_id, run_id):
                self._diagnose(model_id, None, None, run_id=run_id)
            return DeleteReport(model_id, (), 0, tuple(finished), ())
        removed = finished + self.catalog.purge_deleted(self.packs)
        named = {pack_id for d in deletions for pack_id in d.pack_ids}
        return DeleteReport(model_id, tuple(d.run_id for d in deletions), sum(d.n_records for d in deletions),
                            tuple(sorted(removed)), tuple(sorted(named - set(removed))))

    def requests(self, model_id: str, *, run_id: str | None = None) -> list[RequestSummary]:
        """The requests of ``model_id`` (of one run if ``run_id``), oldest run first.

        ``n_tokens`` is the request's stored token count (prompt without padding, plus the
        captured decode steps). Raises ``RecordNotFoundError`` for an unknown model id or run.
        """
        rows = self.catalog.request_totals(model_id, run_id=run_id)
        if not rows:
            self._diagnose(model_id, None, None, run_id=run_id)
        return [RequestSummary(model_id, r.run_id, r.request_id, r.n_tokens,
                               _hook_order(h for h in r.hooks if not _is_text(h)), r.records,
                               r.stored_bytes, r.raw_bytes) for r in rows]

    def contents(self, model_id: str, request_id: str, *, run_id: str | None = None) -> RequestContents:
        """What one request holds: per hook its layers, shard ranks, tensor-parallel layout
        (``tp_layout``, see :func:`tp_layout_text`), tokens, dtype, bytes; and
        the records not captured, each with its reason (``losses``; never silent).

        Raises ``InvalidIdentifierError`` (an id that is not text, or empty, or holds a control
        character), ``RecordNotFoundError`` (unknown model, request or run) and
        ``DuplicateChunkError`` when the request id exists in several runs and ``run_id`` is
        not given.
        """
        run = self._resolve_run(model_id, request_id, run_id)
        held = self.catalog.request_contents(model_id, request_id, run_id=run)
        hooks = {
            h.hook: HookSummary(h.hook, h.layers, h.shard_ranks, h.n_tokens, h.dtype, h.feature_shape, h.n_records,
                                h.stored_bytes, h.raw_bytes, tp_layout_text(h.shard_ranks, h.tp_sizes, h.shard_axes))
            for h in held.values() if not _is_text(h.hook)
        }
        lost = self.catalog.losses(model_id=model_id, run_id=run, request_id=request_id).to_pylist()
        losses = tuple(Loss(r["hook"], int(r["layer"]), int(r["count"]), r["reason"]) for r in lost)
        return RequestContents(model_id, run, request_id, tuple(hooks[h] for h in _hook_order(hooks)), losses,
                               self._phases(model_id, request_id, run))

    def tokens(self, model_id: str, request_id: str, *, run_id: str | None = None) -> RequestTokens | None:
        """One request's prompt text and token strings, with each position's ids and phase
        (``"prefill"``, ``"decode"`` or ``"forward"``), in token order: a
        :class:`dmi.RequestTokens`. Kept when capture was given the tokenizer
        (``dmi.capture(..., tokenizer=)``; ``dmi capture`` and ``dmi demo`` always pass it).

        Returns ``None`` when the request was captured without a tokenizer. Raises
        ``InvalidIdentifierError``, ``RecordNotFoundError`` (unknown model, request or run),
        ``DuplicateChunkError`` (the request id is in several runs and ``run_id`` is not
        given), ``PackCorruptError``/``PackNotFoundError``.
        """
        from dmi._tokens import read_tokens

        _check_read_arguments(model_id, request_id, "token_ids", run_id)
        run = self._resolve_run(model_id, request_id, run_id)
        entries = self.catalog.find_records(model_id, request_id=request_id, hook=("token_ids", *TEXT_HOOKS),
                                            run_id=run)
        return read_tokens(entries, self._read_raw, model_id=model_id, run_id=run, request_id=request_id)

    def _read_raw(self, entries: list[RecordEntry]) -> list[np.ndarray]:
        """The records' decoded bytes (``uint8``), checksums verified, without torch."""
        from dmi.reader import read_raw_records

        return read_raw_records(self.packs, entries, cache=self._footers)

    def _read(self, entries: list[RecordEntry]) -> list[torch.Tensor]:
        """The records' tensors, checksums verified (the store's footer cache)."""
        from dmi.reader import read_records

        return read_records(self.packs, entries, cache=self._footers)

    def _phases(self, model_id: str, request_id: str, run_id: str) -> tuple[PhaseSpan, ...]:
        """Each phase's span of the request's token positions, in token order."""
        spans = self.catalog.request_phases(model_id, request_id, run_id)
        return tuple(PhaseSpan(phase, start, stop) for phase, start, stop in spans)

    # -------------------------------------------------------------------------------- tensors
    def get_internal(self, model_id: str, request_id: str, hook: str, *, layers: Any = None,
                     shard_rank: int | None = None, merge_shards: bool = False,
                     run_id: str | None = None) -> torch.Tensor:
        """One hook of one request as a tensor: ``[layers, tokens, ...]`` for per-layer hooks
        (stored layers in ascending order), ``[tokens, ...]`` for global ones (``token_ids``,
        ``embed``, ``final_norm``, ``logits``). Tokens are in order: the prompt's real tokens
        (padding was never stored), then one per captured decode step.

        ``hook``: a catalogue name or a TransformerLens alias (``blocks.3.hook_resid_post``:
        ``resid_post`` at layer 3, then ``layers`` must be ``None``; see
        ``dmi.capture.ALIASES``). ``layers``: the rule capture uses
        (``dmi.capture.layer_numbers``): an int, a ``range``, a ``slice``, a ``(start, stop)``
        pair or an iterable of layer numbers (``None``: every stored layer); negative numbers
        count back from the last captured layer (``-1`` is the last). Nothing is clipped: a
        layer that was not captured is a ``RecordNotFoundError`` naming the captured ones.
        Tensor-parallel records come back as the model's tensor: shards merged by their
        recorded geometry, replicated copies de-duplicated (``merge_shards=True`` is accepted
        and means the same); ``shard_rank`` selects one rank's records as that rank stored them.

        Raises ``InvalidIdentifierError`` (an id that is not text), ``HookSelectionError``
        (not a hook name, or a TransformerLens name DMI does not capture; an empty or
        malformed layer selection; layers for a global hook), ``InvalidArgumentError``
        (``layers`` with an alias), ``RecordNotFoundError`` (unknown model, request, run, a
        hook or layers the request does not hold),
        ``DuplicateChunkError`` (several runs or ranks hold the same tokens: pass ``run_id``
        or ``shard_rank``), ``MissingShardError`` (a TP rank's shard is absent: it names the ranks
        present and missing), ``ShardMergeError``, ``PackCorruptError``/``PackNotFoundError``.
        """
        hook, layers = _resolve_alias(hook, layers)
        entries = self._entries(model_id, request_id, hook, layers, shard_rank, run_id)
        return self._assemble(entries, shard_rank=shard_rank, merge_shards=merge_shards)

    def lazy(self, model_id: str, request_id: str, hook: str, *, layers: Any = None,
             shard_rank: int | None = None, merge_shards: bool = False,
             run_id: str | None = None) -> LazyInternal:
        """A :class:`LazyInternal` over the same selection as ``get_internal``: the catalog is
        queried now, payloads are read only when the view is indexed (and only the records
        the index touches). Raises what ``get_internal`` raises, except read errors, which
        surface on indexing."""
        from dmi._lazy import LazyInternal

        hook, layers = _resolve_alias(hook, layers)
        entries = self._entries(model_id, request_id, hook, layers, shard_rank, run_id)

        def read(selected: list[RecordEntry]) -> torch.Tensor:
            return self._assemble(selected, shard_rank=shard_rank, merge_shards=merge_shards)

        return LazyInternal(model_id, request_id, hook, entries, read, merged=shard_rank is None)

    def loader(self, model_id: str, *, hooks: Any = "resid_post", layers: Any = None, runs: Any = None,
               phases: Any = None, where: str | None = None, params: dict[str, Any] | None = None,
               **options: Any) -> Any:
        """A :class:`dmi.TokenLoader`: shuffled, resumable, sharded batches of token rows for training.

        Selects the published records of ``model_id`` (``hooks``: one name or several;
        ``layers``: an int or an iterable; ``runs``, ``phases``: one or several; ``where``:
        your own SQL condition over the ``{records}`` columns, values in ``params`` as
        ``%(name)s``). ``options``: ``batch_size``, ``dtype``, ``shuffle``, ``seed``,
        ``shuffle_buffer``, ``layout``, ``with_tokens``, ``normalize``, ``drop_last``,
        ``on_error``, ``num_workers``, ``rank``/``world_size``, ``prefetch``,
        ``read_threads``, ``max_gap``, ``direct_io`` — see ``docs/loader.md``.

        Raises ``RecordNotFoundError`` (nothing selected), ``HookSelectionError``,
        ``InvalidArgumentError``, ``ReaderError`` / ``DuplicateChunkError`` (features that do
        not align token by token), ``ServerError`` (ClickHouse refused ``where``).
        """
        from dmi._loader import open_loader

        return open_loader(self.catalog, self.packs, model_id, hooks=hooks, layers=layers, runs=runs,
                           phases=phases, where=where, params=params, require_model=self._require_model, **options)

    def audit(self, model_id: str, *, model: Any, run_id: str | None = None, requests: int | None = None,
              request_ids: Any = None, seed: int = 0, exact: bool = False, record: bool = True,
              model_name: str | None = None, per_rank: Any = False) -> Any:
        """Re-run a seeded sample of ``model_id``'s captured requests alone through ``model`` and
        compare every captured hook and layer with the re-run; see ``docs/audit.md``.

        ``model``: the ``nn.Module`` that was captured (same weights and dtype), or a built-in
        name / local directory for ``dmi.load_model`` (``smollm2``: its cache in ``self.home``).
        ``requests``: how many to sample (default 8), or ``request_ids``: exactly these. ``exact=True``: the capture ran
        alone on this device, so demand bit-identical values (default: allow the dtype's
        batched-matmul noise). ``record``: write the verdicts to the catalog's audits table.
        ``model_name``: what the audit records as the model (default: the name or class).
        ``per_rank``: audit a tensor-parallel capture on every rank of its TP group, each
        rank with its own shard as ``model`` (every rank calls with the same arguments):
        ``True`` for a model transformers sharded, or the TP ``ProcessGroup`` of a model
        sharded by hand; each rank's records are checked against its own re-run, under the
        ``batched`` tolerance (or ``exact``), and every rank returns every rank's checks.

        Returns a :class:`dmi.AuditReport` (``passed``, ``failures``, ``checks``). Raises
        ``AuditError`` (no token_ids, ``exact=True`` on a tensor-parallel or vLLM capture — TP
        requests are held to the ``tp`` tolerance against the full model, vLLM ones (packs written
        by ``vllm-`` writers) to the ``vllm`` tolerance against the Hugging Face model of the same
        weights —, a model that does not fit; ``per_rank`` outside a TP group, on a capture of
        another TP size, or on a request with no records of this rank — refused on every rank),
        ``RecordNotFoundError``, ``InvalidArgumentError``.
        """
        from dmi._audit import run_audit
        from dmi._audit_rank import run_rank_audit

        name = model_name or (model if isinstance(model, str) else type(model).__name__)
        if isinstance(model, str):
            from dmi._models import load_model

            model = load_model(model, home=self.home).model
        options = dict(model_name=name, run_id=run_id, requests=requests,
                       request_ids=None if request_ids is None else list(request_ids), seed=seed, exact=exact,
                       record=record)
        if per_rank is not False:
            return run_rank_audit(self.catalog, self._read, model_id, model, per_rank, **options)
        return run_audit(self.catalog, self._read, model_id, model, **options)

    def _assemble(self, entries: list[RecordEntry], *, shard_rank: int | None, merge_shards: bool) -> torch.Tensor:
        from dmi.reader import assemble, read_records

        tensors = read_records(self.packs, entries, cache=self._footers)
        return assemble(entries, tensors, shard_rank=shard_rank, merge_shards=merge_shards)

    def _entries(self, model_id: str, request_id: str, hook: str, layers: Any, shard_rank: int | None,
                 run_id: str | None) -> list[RecordEntry]:
        _check_read_arguments(model_id, request_id, hook, run_id)
        run = self._resolve_run(model_id, request_id, run_id)
        entries = self.catalog.find_records(model_id, request_id=request_id, hook=hook, shard_rank=shard_rank,
                                            run_id=run)
        if not entries:
            self._diagnose(model_id, request_id, hook, run_id=run, layers=layers, shard_rank=shard_rank)
        return _select_layers(entries, layers, f"request {request_id!r} hook {hook!r}")

    def _resolve_run(self, model_id: str, request_id: str, run_id: str | None) -> str:
        """The one run holding ``request_id``; refuses to guess between several. A ``run_id``
        that is not an id is an ``InvalidIdentifierError`` (not a run the model lacks)."""
        from dmi.catalog import validate_value_id

        if run_id is not None:
            validate_value_id(run_id, "run id")
        runs = self.catalog.request_runs(model_id, request_id)
        if run_id is not None:
            if run_id not in runs:
                self._diagnose(model_id, request_id, None, run_id=run_id)
            return run_id
        if not runs:
            self._diagnose(model_id, request_id, None)
        if len(runs) > 1:
            raise DuplicateChunkError(
                f"request {request_id} of model {model_id} was captured in {len(runs)} runs ({', '.join(runs)}); "
                "choose one with run_id= (dmi: --run)"
            )
        return runs[0]

    def _require_model(self, model_id: str) -> None:
        """Raise ``RecordNotFoundError`` naming the catalog's models, unless ``model_id`` is one."""
        models = self.catalog.models()
        if model_id not in models:
            known = ", ".join(models[:10]) + (" ..." if len(models) > 10 else "") if models else "none yet"
            raise RecordNotFoundError(f"no model {model_id!r} in the catalog at {self.catalog_uri} (models: {known})")

    def _diagnose(self, model_id: str, request_id: str | None, hook: str | None, *, run_id: str | None = None,
                  layers: Any = None, shard_rank: int | None = None) -> None:
        """Raise ``RecordNotFoundError`` naming the first part of the selection that matches nothing."""
        from dmi._human import plural

        self._require_model(model_id)
        if run_id is not None and run_id not in self.catalog.runs(model_id):
            raise RecordNotFoundError(
                f"model {model_id!r} has no run {run_id!r} (list runs with `dmi runs {shlex.quote(model_id)}`)"
            )
        if request_id is None:
            raise RecordNotFoundError(f"model {model_id!r} has no published requests")
        requests = self.catalog.requests(model_id, run_id=run_id)
        if request_id not in requests:
            raise RecordNotFoundError(
                f"model {model_id!r} has no request {request_id!r}{'' if run_id is None else f' in run {run_id}'} "
                f"({plural(len(requests), 'request')}; list them with `dmi requests {shlex.quote(model_id)}`)"
            )
        held = self.catalog.request_contents(model_id, request_id, run_id=run_id)
        if hook not in held:
            raise RecordNotFoundError(
                f"request {request_id!r} holds no {hook!r} records; it holds: "
                f"{', '.join(_hook_order(h for h in held if not _is_text(h))) or 'nothing'}"
            )
        raise RecordNotFoundError(
            f"request {request_id!r} hook {hook!r} has layers {list(held[hook].layers)} and shard ranks "
            f"{list(held[hook].shard_ranks)}; nothing matches layers={layers!r} shard_rank={shard_rank!r}"
        )

    # -------------------------------------------------------------------------------- upkeep
    def verify(self, *, model_id: str | None = None,
               progress: Callable[[int], AbstractContextManager[Any]] | None = None) -> VerifyReport:
        """Read back every published record (of ``model_id``, or all) and check it.

        Each record's stored bytes are checked against its checksum and decoded, and the
        catalog's row is checked against the pack's own index. Returns a report listing
        every bad record by pack and key (``kind`` ``"corrupt"``), every missing pack
        (``"missing"``), every pack whose records read back whole but whose file is damaged
        elsewhere (``"damaged"``: its rows, its leading schema message), and sealed packs on disk the catalog does not fully show — never
        published, or index rows lost (run ``recover``).
        Raises only for catalog errors, a ``model_id`` that is not an id
        (``InvalidIdentifierError``) and an unknown one (``RecordNotFoundError``); bad packs
        are reported, not raised. ``progress(total_records)`` may return a context manager
        with ``update(n)``.
        """
        from dmi.catalog import validate_value_id

        if model_id is not None:
            validate_value_id(model_id, "model id")  # not text: an argument error, not a model the catalog lacks
        models = [model_id] if model_id is not None else self.catalog.models()
        if model_id is not None and model_id not in self.catalog.models():
            self._diagnose(model_id, None, None)
        by_pack: dict[str, list[RecordEntry]] = defaultdict(list)
        for model in models:
            for entry in self.catalog.find_records(model):
                by_pack[entry.pack_id].append(entry)
        total = sum(len(v) for v in by_pack.values())
        problems: list[Problem] = []
        checked_bytes = 0
        bar = progress(total) if progress is not None else nullcontext()
        with bar as tick:
            for pack_id in sorted(by_pack):
                entries = by_pack[pack_id]
                problems.extend(self._verify_pack(pack_id, entries))
                checked_bytes += sum(e.payload.length for e in entries)
                if tick is not None:
                    tick.update(len(entries))
        unpublished = tuple(sorted(self.unindexed_packs()))
        return VerifyReport(total, len(by_pack), checked_bytes, tuple(problems), unpublished)

    def _verify_pack(self, pack_id: str, entries: list[RecordEntry]) -> list[Problem]:
        """Problems of one pack: one for a missing file or an unreadable index (with how many
        records it holds), then one per record whose bytes fail their checksum or decoding."""
        from dmi.reader import FooterCache, load_footer, read_record

        try:
            found = self._verify_whole(pack_id, entries)
        except PackNotFoundError as exc:
            return [Problem("missing", pack_id, None, f"{len(entries)} records lost: {exc}")]
        if found is not None:
            return found
        fresh = FooterCache()  # a fresh footer each time: verify must not trust an earlier read
        problems = []
        try:
            load_footer(self.packs, pack_id, cache=fresh)
        except PackError as exc:
            problems.append(Problem("corrupt", pack_id, None, f"pack index unreadable ({len(entries)} records): {exc}"))
            fresh = None  # still check each record's own bytes against the catalog's checksum
        for entry in entries:  # find every bad record, not just the first
            try:
                read_record(self.packs, entry, cache=fresh)
            except PackError as exc:
                problems.append(Problem("corrupt", pack_id, entry.meta.key, str(exc)))
        return problems

    def _verify_whole(self, pack_id: str, entries: list[RecordEntry]) -> list[Problem] | None:
        """The pack read once, whole (:func:`dmi.storage.read_whole_pack`): its records read back
        from those bytes (against its own index, their checksums, their decoding), then, if all
        read back whole, the same bytes checked as a file (:meth:`_damage_beside_records`).
        ``None`` when a record does not read back or the file cannot be read whole: the caller
        then checks record by record. A missing pack raises ``PackNotFoundError``."""
        from dmi.reader import check_records
        from dmi.storage import read_whole_pack

        try:
            pack = read_whole_pack(self.packs, pack_id)
            check_records(pack.descriptor, pack.data, entries)
        except PackNotFoundError:
            raise
        except PackError:
            return None
        return self._damage_beside_records(pack, len(entries))

    def _damage_beside_records(self, pack: WholePack, n_records: int) -> list[Problem]:
        """A pack whose records read back whole, checked as a whole file from the same bytes (rows
        against its index, every checksum, the leading schema message against the footer:
        :func:`dmi.storage.check_whole_pack`): damage no record's read touches, which a copy, a
        recovery or a tool reading the file from its start would meet, is a ``"damaged"``
        problem."""
        from dmi.storage import check_whole_pack

        try:
            check_whole_pack(pack)
        except PackError as exc:
            return [Problem("damaged", pack.descriptor.pack_id, None,
                            f"the file is damaged beside its {n_records} records, which read back whole: {exc}")]
        return []

    def unindexed_packs(self) -> list[str]:
        """Sealed packs on disk that the catalog does not fully show (``recover`` re-indexes them)."""
        return self.catalog.packs_to_recover(self.packs.list_packs())

    def recover(self) -> list[RecoveredPack]:
        """Re-index and publish every sealed pack the catalog does not fully show.

        Packs carry their own index: a crash between seal and publish, catalog tables
        dropped, the catalog directory deleted or index rows lost are all repaired from
        the packs on disk, each record published exactly once.

        Returns the packs published now (empty when there is nothing to do; running it
        twice publishes nothing the second time). Raises ``LeaseHeldError`` while another
        recovery holds the lease, ``PackCorruptError`` for a pack whose index is unreadable (before
        anything is published), and ``RecoveryIncompleteError`` naming every entry named like a
        pack that is not a regular file (a FIFO, a directory) once every pack has been recovered
        around them (its ``recovered`` and ``skipped`` say which).
        """
        ids = self.catalog.recover(self.packs)
        if not ids:
            return []
        counts = self.catalog.pack_record_counts(ids)
        return [RecoveredPack(pack_id, counts.get(pack_id, 0)) for pack_id in ids]


# ------------------------------------------------------------------------------------ helpers


def tp_layout_text(shard_ranks: tuple[int, ...], tp_sizes: tuple[int, ...], shard_axes: tuple[int, ...]) -> str:
    """How tensor parallelism holds one hook, in words: ``""`` (not sharded), ``"split on
    axis 1 over 2 ranks"`` (with ``"; rank(s) [1] missing"`` when some never published), or
    ``"replicated on 2 ranks, stored by rank(s) [0]"``."""
    size = max(tp_sizes, default=1)
    if size <= 1:
        return ""
    axes = [a for a in shard_axes if a >= 0]
    if not axes:
        return f"replicated on {size} ranks, stored by rank(s) {list(shard_ranks)}"
    text = f"split on axis {','.join(map(str, axes))} over {size} ranks"
    missing = sorted(set(range(size)) - set(shard_ranks))
    return f"{text}; rank(s) {missing} missing" if missing else text


_SYNTAX_ERROR = 62
"""ClickHouse's SYNTAX_ERROR: what a ``{word}`` left in the text gives (it reads as a query
parameter without its type)."""

_BRACED_WORD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A ``{word}`` in SQL text: a table placeholder, or a typo for one (a ClickHouse query parameter
is ``{name:Type}``, and a map literal holds a colon too)."""


def _check_hook(hook: str) -> None:
    if hook in HOOK_ORDER:
        return
    from dmi.capture import GROUPS

    hint = f" ({hook!r} is a group: read its hooks one by one)" if hook in GROUPS else ""
    if _is_text(hook):
        hint = f" ({hook!r} records hold text: read them with Store.tokens, or `dmi show`)"
    raise HookSelectionError(f"unknown hook {hook!r}{hint}; hooks: {', '.join(HOOK_ORDER)}")


def _resolve_alias(hook: Any, layers: Any) -> tuple[Any, Any]:
    """A TransformerLens name → its catalogue hook and its one layer; other names unchanged.
    Raises ``HookSelectionError`` for a TransformerLens name DMI does not capture, and
    ``InvalidArgumentError`` when ``layers`` is given with an alias (which names its layer)."""
    from dmi.capture import resolve_alias

    alias = resolve_alias(hook) if isinstance(hook, str) else None
    if alias is None:
        return hook, layers
    if layers is not None:
        what = "a global hook" if alias.layer < 0 else f"layer {alias.layer}"
        raise InvalidArgumentError(
            f"{hook!r} names its layer ({what}); drop layers={layers!r}, or read {alias.hook!r} with layers="
        )
    return alias.hook, None if alias.layer < 0 else [alias.layer]


def _is_text(hook: str) -> bool:
    """Whether ``hook`` names the token strings' records (not a hook of the model)."""
    return hook in TEXT_HOOKS


def _hook_order(hooks: Iterable[str]) -> tuple[str, ...]:
    """Catalogue order (the order of the model's computation), unknown names last."""
    order = {name: i for i, name in enumerate(HOOK_ORDER)}
    return tuple(sorted(hooks, key=lambda h: (order.get(h, len(order)), h)))


def _check_read_arguments(model_id: Any, request_id: Any, hook: Any, run_id: Any) -> None:
    """Refuse arguments of the wrong type where they enter, before any query: an id that is
    not text (``InvalidIdentifierError``), a hook that is not a catalogue name
    (``HookSelectionError``). The catalog checks ``shard_rank`` itself."""
    from dmi.catalog import validate_value_id

    validate_value_id(model_id, "model id")
    validate_value_id(request_id, "request id")
    if run_id is not None:
        validate_value_id(run_id, "run id")
    if not isinstance(hook, str):
        raise HookSelectionError(f"a hook is a name such as 'resid_post', not {hook!r}")
    _check_hook(hook)


def _select_layers(entries: list[RecordEntry], layers: Any, where: str) -> list[RecordEntry]:
    """The records of the selected layers, by the rule capture uses (``layer_numbers``),
    applied to the layers the request holds: a layer that was not captured is an error
    naming the captured ones, never silently dropped."""
    from dmi.capture import layer_numbers

    held = sorted({e.meta.key.layer for e in entries})
    if held == [GLOBAL_LAYER]:
        if layers is not None:
            raise HookSelectionError(f"{where} is a global hook (no layers): read it without layers")
        return entries
    wanted = layer_numbers(layers, held[-1] + 1, f"{where} has layers {held}")
    if wanted is None:
        return entries
    missing = sorted(set(wanted) - set(held))
    if missing:
        raise RecordNotFoundError(
            f"{where} has layers {held}; layers={layers!r} asks for {missing}, which were not captured"
        )
    return [e for e in entries if e.meta.key.layer in wanted]
