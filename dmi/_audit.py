"""``store.audit`` / ``dmi audit``: prove a capture right after the fact.

A seeded sample of captured requests is re-run one by one, alone, through the model
(:mod:`dmi._audit_rerun`), and every captured hook and layer of those requests is compared
with the re-run (:mod:`dmi._audit_compare`): token ids first (the request's ``token_ids``
records must cover its positions once each, and every other record must sit at the step
and phase its positions were fed in), then values. Only the sampled requests' records are
read. The verdicts are written to the catalog's audits table (``Catalog.audits``).

A tensor-parallel capture is audited as the reader returns it: the records of one
(hook, layer, position) — one per rank for a sharded hook — are merged by their recorded
geometry (:func:`dmi.reader.assemble`) and the model's full tensor is compared with an
unsharded re-run under the ``tp`` tolerance. A shard that cannot be merged (a rank
missing, slices that overlap) is a failure at its position, not an exception. A model too
large for one process is audited per rank instead, each TP rank re-running its own shard
(``per_rank=``, :mod:`dmi._audit_rank`).

A vLLM capture (its packs' writer id starts with ``vllm-``, ``dmi.capture.VLLM_WRITER_PREFIX``;
found with one catalog query per audit) is re-run through Hugging Face with the same weights
and held to the ``vllm`` tolerance: vLLM's kernels compute the same model with other
numerics. Its records need nothing else: ``step`` is the engine's forward index, and a
request's token_ids say at which forward each of its positions (a prompt chunk, a decode
token) was fed, which is all the placement check compares.
"""

from __future__ import annotations

import random
import secrets
import shlex
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dmi._audit_compare import Difference, compare, tolerance
from dmi._audit_rerun import Reference, rerun_alone
from dmi.storage.errors import AuditError, InvalidArgumentError, MissingShardError, ReaderError, RecordNotFoundError
from dmi.storage.records import RecordEntry

__all__ = ["AuditCheck", "AuditReport", "RequestPlan", "run_audit", "choose_requests", "sample_requests",
           "plan_request", "check_request", "audit_request", "new_report", "new_audit_id", "audit_rows", "request_kind",
           "vllm_requests"]

ReadRecords = Callable[[list[RecordEntry]], list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class AuditCheck:
    """The verdict on one (request, hook, layer): ``"exact"`` (bit-identical to the re-run),
    ``"noise"`` (within the tolerance ``bound`` of kind ``tolerance``) or ``"fail"``.

    A failure says where: ``first_fail`` is the first position beyond the bound (``None``
    when the failure is structural), ``detail`` what was wrong. ``shard_rank``: in a
    per-rank audit, the TP rank whose own records (and re-run) were checked; ``None`` when
    the records of every rank were checked together.
    """

    run_id: str
    request_id: str
    hook: str
    layer: int
    verdict: str
    tolerance: str
    bound: float
    n_records: int
    n_tokens: int
    max_abs: float = 0.0
    max_rel: float = 0.0
    rel_l2: float = 0.0
    first_diff: int | None = None
    first_fail: int | None = None
    detail: str = ""
    shard_rank: int | None = None

    @property
    def failed(self) -> bool:
        return self.verdict == "fail"

    def describe(self) -> str:
        """One line naming the request, hook, layer and (on failure) the first bad position."""
        where = "global" if self.layer < 0 else f"layer {self.layer}"
        rank = "" if self.shard_rank is None else f" on TP rank {self.shard_rank}"
        text = f"request {self.request_id} {self.hook} {where}{rank}: {self.verdict}"
        if self.verdict != "exact":
            text += f" (max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, rel L2 {self.rel_l2:.3g}"
            text += f"; {self.tolerance} bound {self.bound:.3g})"
        if self.first_fail is not None:
            text += f", first position beyond it: {self.first_fail}"
        return text + (f": {self.detail}" if self.detail else "")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class AuditReport:
    """One audit: which requests of ``model_id`` were re-run (``requests``: ``(run, request)``
    pairs) against ``model``, and a check per (request, hook, layer). ``tolerance``: the
    kinds the checks were held to, in order of first use (``"batched"``; ``"batched, tp"``
    when the sample reached a tensor-parallel run too, ``"vllm"`` for a vLLM capture)."""

    audit_id: str
    model_id: str
    model: str
    seed: int
    tolerance: str
    audited_at: float
    requests: tuple[tuple[str, str], ...]
    checks: tuple[AuditCheck, ...]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[AuditCheck, ...]:
        return tuple(c for c in self.checks if c.failed)

    def as_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in ("audit_id", "model_id", "model", "seed", "tolerance",
                                                  "audited_at")},
                "passed": self.passed, "requests": [list(r) for r in self.requests],
                "checks": [c.as_dict() for c in self.checks]}


# ------------------------------------------------------------------------------ sampling


def sample_requests(token_entries: Sequence[RecordEntry], n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` requests chosen with ``seed``, spread over runs, batch positions and prompt lengths.

    Requests are grouped by (run, prompt-length quartile within the run); groups are
    visited round-robin in a seeded order, each giving its requests in a seeded order, so
    a small sample still reaches every run, short and long prompts, and (since request ids
    follow batch rows) early and late rows of a batch. Decode steps need no sampling: every
    captured step of a chosen request is checked.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"requests must be a positive int, not {n!r}")
    prompt: dict[tuple[str, str], int] = defaultdict(int)
    for e in token_entries:
        k = e.meta.key
        prompt[(k.run_id, k.request_id)] += k.n_tokens if k.phase != "decode" else 0
    rng = random.Random(seed)
    groups: dict[tuple[str, int], list[tuple[str, str]]] = defaultdict(list)
    by_run: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for pair in sorted(prompt):
        by_run[pair[0]].append(pair)
    for run, pairs in by_run.items():
        ranked = sorted(pairs, key=lambda p: (prompt[p], p[1]))
        for i, pair in enumerate(ranked):
            groups[(run, 4 * i // len(ranked))].append(pair)
    queues = [rng.sample(members, len(members)) for _, members in sorted(groups.items())]
    rng.shuffle(queues)
    chosen: list[tuple[str, str]] = []
    while len(chosen) < n and any(queues):
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop())
    return chosen


# ------------------------------------------------------------------------------ one request


def _token_problems(tokens: list[RecordEntry]) -> str:
    """Why the request's ``token_ids`` records do not cover positions 0.. once each ('' if they do)."""
    pos = 0
    for e in tokens:
        k = e.meta.key
        if k.start_token != pos:
            what = "overlap" if k.start_token < pos else "gap"
            return f"token_ids records {what} at position {min(pos, k.start_token)} (a record starts at {k.start_token})"
        pos += k.n_tokens
    return ""


def _step_at(tokens: list[RecordEntry], position: int) -> tuple[int, str] | None:
    """The (step, phase) in which ``position`` was fed, from the token_ids records."""
    for e in tokens:
        k = e.meta.key
        if k.start_token <= position < k.start_token + k.n_tokens:
            offset = position - k.start_token if k.phase == "decode" else 0
            return k.step + offset, k.phase
    return None


def _placement_problem(entry: RecordEntry, tokens: list[RecordEntry], total: int) -> str:
    """Why a record is not where its request's tokens say it must be ('' when it is)."""
    k = entry.meta.key
    if k.start_token < 0 or k.start_token + k.n_tokens > total:
        return f"record covers positions [{k.start_token}, {k.start_token + k.n_tokens}) but the request has {total} tokens"
    fed = _step_at(tokens, k.start_token)
    if fed != (k.step, k.phase):
        return (f"record at position {k.start_token} says step {k.step} ({k.phase}); "
                f"token_ids say that position was fed at step {fed[0]} ({fed[1]})")
    return ""


def _fail(run: str, rid: str, hook: str, layer: int, kind: str, bound: float, entries: list[RecordEntry],
          detail: str, first: int | None = None) -> AuditCheck:
    n = sum(e.meta.key.n_tokens for e in entries)
    return AuditCheck(run, rid, hook, layer, "fail", kind, bound, len(entries), n, first_fail=first, detail=detail)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What one request's re-run and checks need, found before anything is re-run.

    ``tokens``: its ``token_ids`` records (one rank's copy), ``ids`` the tokens they hold
    (``None`` when the records do not cover the request: ``token_check`` then says why and
    nothing is re-run), ``groups`` its other records by ``(hook, layer)``.
    """

    run: str
    request_id: str
    kind: str
    tokens: tuple[RecordEntry, ...]
    ids: torch.Tensor | None
    prompt_len: int
    generate: bool
    groups: dict[tuple[str, int], list[RecordEntry]]
    token_check: AuditCheck

    def rerun(self, model: Any, groups: dict[tuple[str, int], list[RecordEntry]] | None = None) -> Reference:
        """The request re-run alone through ``model``, keeping ``groups``' hooks (default: all)."""
        wanted: dict[str, set[int]] = defaultdict(set)
        for hook, layer in self.groups if groups is None else groups:
            wanted[hook].add(layer)
        return rerun_alone(model, self.ids, self.prompt_len, generate=self.generate,
                           wanted={h: tuple(sorted(l)) for h, l in wanted.items()})


def plan_request(model: Any, run: str, rid: str, entries: list[RecordEntry], read: ReadRecords,
                 kind: str) -> RequestPlan:
    """One request's plan (``entries``: all its records; its token strings, which the model
    does not compute, are left out) under the tolerance ``kind`` (see :func:`request_kind`).
    Raises :class:`AuditError` for a request without token_ids or a model that cannot
    re-run it."""
    from dmi.capture import TEXT_HOOKS

    entries = [e for e in entries if e.meta.key.hook not in TEXT_HOOKS]
    tokens = _one_copy(sorted((e for e in entries if e.meta.key.hook == "token_ids"),
                              key=lambda e: e.meta.key.start_token))
    if not tokens:
        raise AuditError(f"request {rid} (run {run}) has no token_ids records; an audit re-runs the captured "
                         "tokens: capture with the token_ids hook (e.g. hooks='resid_post token_ids')")
    groups: dict[tuple[str, int], list[RecordEntry]] = defaultdict(list)
    for e in entries:
        if e.meta.key.hook != "token_ids":
            groups[(e.meta.key.hook, e.meta.key.layer)].append(e)
    problem = _token_problems(tokens)
    if problem:
        return RequestPlan(run, rid, kind, tuple(tokens), None, 0, False, dict(groups),
                           _fail(run, rid, "token_ids", -1, kind, 0.0, tokens, problem))
    _check_model(model, entries)
    ids = torch.cat(read(tokens))
    return RequestPlan(run, rid, kind, tuple(tokens), ids,
                       sum(e.meta.key.n_tokens for e in tokens if e.meta.key.phase != "decode"),
                       tokens[0].meta.key.phase == "prefill", dict(groups),
                       AuditCheck(run, rid, "token_ids", -1, "exact", kind, 0.0, len(tokens), len(ids)))


def check_request(plan: RequestPlan, ref: Reference, read: ReadRecords,
                  groups: dict[tuple[str, int], list[RecordEntry]] | None = None, *,
                  shard_rank: int | None = None) -> list[AuditCheck]:
    """The checks of ``groups`` (default: all the plan's) against the re-run ``ref``;
    ``shard_rank``: compare that rank's own records as they are (a per-rank audit) rather
    than merging every rank's shards."""
    checks = []
    groups = plan.groups if groups is None else groups
    for (hook, layer), group in sorted(groups.items(), key=lambda kv: (_hook_rank(kv[0][0]), kv[0][1])):
        group = sorted(group, key=lambda e: e.meta.key.start_token)
        checks.append(_check_group(plan, hook, layer, group, ref, read, shard_rank=shard_rank))
    return checks


def audit_request(model: Any, run: str, rid: str, entries: list[RecordEntry], read: ReadRecords,
                  kind: str) -> list[AuditCheck]:
    """Every check of one request (see :func:`plan_request`), its re-run in this process."""
    plan = plan_request(model, run, rid, entries, read, kind)
    if plan.ids is None:
        return [plan.token_check]
    return [plan.token_check, *check_request(plan, plan.rerun(model), read)]


def request_kind(run: str, rid: str, entries: list[RecordEntry], kind: str, *, vllm: bool = False) -> str:
    """The tolerance kind of one request: ``vllm`` when vLLM captured it (``vllm``: its packs
    were written by a vLLM capture), ``tp`` when it was captured with tensor parallelism
    (an unsharded re-run can never be bit-identical to either), else ``kind``."""
    if vllm:
        if kind == "exact":
            raise AuditError(f"request {rid} (run {run}) was captured by vLLM: the Hugging Face re-run computes "
                             "the same weights with other kernels (fused add + RMSNorm, vLLM's attention and "
                             "GEMMs), so it cannot be bit-identical; audit it without exact=True (--exact), "
                             "under the vllm tolerance")
        return "vllm"
    sizes = {e.meta.key.tp_size for e in entries}
    if max(sizes, default=1) == 1:
        return kind
    if kind == "exact":
        raise AuditError(f"request {rid} (run {run}) was captured with tensor parallelism ({max(sizes)} ranks): "
                         "an unsharded re-run sums the row-parallel products in another order, so it cannot be "
                         "bit-identical; audit it without exact=True (--exact), under the tp tolerance")
    return "tp"


def _one_copy(tokens: list[RecordEntry]) -> list[RecordEntry]:
    """A TP request's token_ids as one rank wrote them (the lowest rank present: with
    ``tp_replicas="all"`` every rank writes a copy); other requests' records as they are."""
    if not tokens or tokens[0].meta.key.tp_size == 1:
        return tokens
    first = min(e.meta.key.shard_rank for e in tokens)
    return [e for e in tokens if e.meta.key.shard_rank == first]


def _check_model(model: Any, entries: list[RecordEntry]) -> None:
    """Refuse a re-run model that cannot hold the captured hooks, computes in another dtype or
    gives a hook another per-token shape than its stored records (another size of the same
    architecture): a model that does not match is refused, not judged record by record."""
    from dmi.capture import TEXT_HOOKS, ModelGeometry, resolve_architecture

    arch = resolve_architecture(model)
    values = [e for e in entries if e.meta.key.hook not in ("token_ids", *TEXT_HOOKS)]
    for hook, layer in sorted({(e.meta.key.hook, e.meta.key.layer) for e in values}):
        if layer >= arch.n_layers or not arch.available(hook):
            raise AuditError(f"the model given for the re-run ({arch.model_type}, {arch.n_layers} layers) has no "
                             f"{hook} at layer {layer}: is it the model that was captured?")
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    captured = {e.meta.dtype for e in values if e.meta.key.hook != "router_topk"}
    if captured and captured != {_dtype_name(dtype)}:
        raise AuditError(f"the capture holds {', '.join(sorted(captured))} values but the model given computes in "
                         f"{_dtype_name(dtype)}; load it in the captured dtype")
    _check_shapes(values, ModelGeometry.from_config(model.config, dtype))


def _check_shapes(entries: list[RecordEntry], geometry: Any) -> None:
    """Refuse a model whose per-token shape of a captured hook (``HookSpec.feature_shape``)
    is not the one its stored records hold, naming both (a wider model fails every
    comparison on shape, which says nothing about the capture)."""
    from dmi.capture import HOOKS

    stored: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for e in entries:
        stored[e.meta.key.hook].add(_feature_shape(e))
    for hook in sorted(stored, key=_hook_rank):
        expected = tuple(HOOKS[hook].feature_shape(geometry))
        if stored[hook] != {expected}:
            held = " and ".join(map(str, sorted(stored[hook])))
            raise AuditError(f"the capture's {hook} records are {held} per token but the model given for the "
                             f"re-run ({geometry.model_type}, hidden {geometry.hidden}) gives {expected}: is it the "
                             "model that was captured? Audit with the model (and size) the capture used")


def _feature_shape(entry: RecordEntry) -> tuple[int, ...]:
    """One token's shape in ``entry``: its full (unsharded) record shape without the token
    axis and, for attention patterns, the key axis."""
    meta = entry.meta
    shape = meta.shard.full_shape if meta.shard is not None else meta.shape
    return tuple(d for axis, d in enumerate(shape) if axis not in (meta.token_axis, meta.key_axis))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _hook_rank(hook: str) -> int:
    from dmi.capture import HOOKS

    return list(HOOKS).index(hook) if hook in HOOKS else len(HOOKS)


def _check_group(plan: RequestPlan, hook: str, layer: int, group: list[RecordEntry], ref: Reference,
                 read: ReadRecords, *, shard_rank: int | None = None) -> AuditCheck:
    """One (hook, layer) of one request: where each chunk (the records of one position)
    sits, then the values of those that sit where their tokens were fed — for a TP capture
    the shards merged as the reader merges them, or with ``shard_rank`` that rank's own
    records as they are (a position other ranks recorded and it did not is a problem).
    The first problem of any kind is named."""
    problems: list[tuple[int, str]] = []
    placed: list[list[RecordEntry]] = []
    tokens, total = list(plan.tokens), len(plan.ids)
    for chunk in _chunks(group):
        k = chunk[0].meta.key
        if shard_rank is not None:
            chunk = [e for e in chunk if e.meta.key.shard_rank == shard_rank]
            if not chunk:
                problems.append((k.start_token, f"TP rank {shard_rank} has no record at position {k.start_token} "
                                                 "(another rank has)"))
                continue
        problem = _chunk_problem(chunk, shard_rank is not None) or next(
            (p for p in (_placement_problem(e, tokens, total) for e in chunk) if p), "")
        if problem:
            problems.append((k.start_token, problem))
        else:
            placed.append(chunk)
    diffs: list[Difference] = []
    bound = tolerance(plan.kind, _dtype_of(group[0]))
    for chunk, data in zip(placed, _read_chunks(placed, read, merge=shard_rank is None)):
        k = chunk[0].meta.key
        if isinstance(data, str):
            problems.append((k.start_token, data))
            continue
        want = ref.span(hook, layer, k.start_token, k.n_tokens)
        if want.numel() != data.numel():
            problems.append((k.start_token, f"record at position {k.start_token} has shape {tuple(data.shape)}, "
                                            f"the re-run {tuple(want.shape)}"))
            continue
        diffs.append(compare(data, want.reshape(data.shape).to(data.dtype),
                             token_axis=1 if hook == "attn_pattern" else 0, start=k.start_token, bound=bound))
    kept = [e for e in group if shard_rank is None or e.meta.key.shard_rank == shard_rank]
    return _merge(plan, hook, layer, bound, kept, diffs, sorted(problems), shard_rank)


def _chunks(group: list[RecordEntry]) -> list[list[RecordEntry]]:
    """``group``'s records by start position (sorted), each position's by shard rank."""
    by_start: dict[int, list[RecordEntry]] = defaultdict(list)
    for e in group:
        by_start[e.meta.key.start_token].append(e)
    return [sorted(by_start[s], key=lambda e: e.meta.key.shard_rank) for s in sorted(by_start)]


def _chunk_problem(chunk: list[RecordEntry], one_rank: bool) -> str:
    """Why the records of one position are not one record (TP: one per rank, which the
    merge checks; ``one_rank``: the records of one rank) — '' when they are."""
    k = chunk[0].meta.key
    if len(chunk) > 1 and (k.tp_size == 1 or one_rank):
        return f"two records start at position {k.start_token}"
    return ""


def _read_chunks(chunks: list[list[RecordEntry]], read: ReadRecords, *, merge: bool) -> list[torch.Tensor | str]:
    """Each chunk's tensor (records of all chunks read in one go), or why its TP shards do
    not form the model's tensor (``merge``: TP chunks are merged; otherwise each chunk is
    one record, returned as stored)."""
    flat = [e for chunk in chunks for e in chunk]
    tensors = iter(read(flat) if flat else [])
    out: list[torch.Tensor | str] = []
    for chunk in chunks:
        mine = [next(tensors) for _ in chunk]
        out.append(_merged(chunk, mine) if merge and chunk[0].meta.key.tp_size > 1 else mine[0])
    return out


def _merged(chunk: list[RecordEntry], tensors: list[torch.Tensor]) -> torch.Tensor | str:
    """One position's TP records as the reader returns them: shards merged by their recorded
    geometry, replicated copies de-duplicated (:func:`dmi.reader.assemble`)."""
    from dmi.reader import assemble

    k = chunk[0].meta.key
    try:
        merged = assemble(chunk, tensors)
    except MissingShardError as exc:
        return (f"TP rank(s) {list(exc.missing)} of {k.tp_size} missing at position {k.start_token} "
                f"(present: {list(exc.present)}): the full tensor cannot be formed")
    except ReaderError as exc:
        return f"TP shards at position {k.start_token} cannot be merged: {exc}"
    return merged if k.layer < 0 else merged[0]


def _dtype_of(entry: RecordEntry) -> torch.dtype:
    return getattr(torch, entry.meta.dtype)


def _merge(plan: RequestPlan, hook: str, layer: int, bound: float, group: list[RecordEntry],
           diffs: list[Difference], problems: list[tuple[int, str]], shard_rank: int | None) -> AuditCheck:
    kind = plan.kind
    fails = [(d.first_fail, f"values differ beyond the {kind} tolerance from position {d.first_fail}")
             for d in diffs if d.first_fail is not None]
    first = min(fails + problems) if fails or problems else None
    firsts = [d.first_diff for d in diffs if d.first_diff is not None] + [p for p, _ in problems]
    verdict = "fail" if first else ("exact" if all(d.exact for d in diffs) else "noise")
    return AuditCheck(
        plan.run, plan.request_id, hook, layer, verdict, kind, bound, len(group),
        sum(e.meta.key.n_tokens for e in group),
        max_abs=max((d.max_abs for d in diffs), default=0.0), max_rel=max((d.max_rel for d in diffs), default=0.0),
        rel_l2=max((d.rel_l2 for d in diffs), default=0.0), first_diff=min(firsts) if firsts else None,
        first_fail=first[0] if first else None, detail=first[1] if first else "", shard_rank=shard_rank,
    )


# ------------------------------------------------------------------------------ the audit


def run_audit(catalog: Any, read: ReadRecords, model_id: str, model: Any, *, model_name: str,
              run_id: str | None = None, requests: int | None = None, request_ids: Sequence[str] | None = None,
              seed: int = 0, exact: bool = False, record: bool = True) -> AuditReport:
    """Audit ``model_id``'s capture against ``model`` (see ``Store.audit``) in this process
    (per rank: :func:`dmi._audit_rank.run_rank_audit`)."""
    kind = "exact" if exact else "batched"
    started = time.time()  # before anything is read: a deletion decided while it runs hides it
    entries = choose_requests(catalog, model_id, run_id, requests, request_ids, seed)
    vllm = vllm_requests(catalog, entries)
    # every request's tolerance before any re-run: a refusal (exact=True on TP or vLLM) costs nothing
    request_kinds = {pair: request_kind(*pair, entries[pair], kind, vllm=pair in vllm) for pair in entries}
    _check_model(model, [e for pair in entries for e in entries[pair]])  # a model that does not match: refused
    checks: list[AuditCheck] = []
    for pair in entries:
        checks.extend(audit_request(model, *pair, entries[pair], read, request_kinds[pair]))
    report = new_report(model_id, model_name, seed, tuple(entries), checks, kind, audited_at=started)
    if record:
        catalog.record_audit(audit_rows(report))
    return report


def choose_requests(catalog: Any, model_id: str, run_id: str | None, requests: int | None,
                    request_ids: Sequence[str] | None, seed: int) -> dict[tuple[str, str], list[RecordEntry]]:
    """The audited ``(run, request)`` pairs, in order, each with all its records: exactly
    ``request_ids``, or a seeded sample of ``requests`` (default 8)."""
    if requests is not None and request_ids is not None:
        raise InvalidArgumentError("give requests=N (a sample) or request_ids=[...], not both")
    if request_ids is not None:
        chosen = _named(catalog, model_id, run_id, list(request_ids))
    else:
        token_entries = catalog.find_records(model_id, hook="token_ids", run_id=run_id)
        if not token_entries:
            _require_known(catalog, model_id, run_id)
            raise AuditError(f"model {model_id!r}{'' if run_id is None else f' run {run_id!r}'} has no requests "
                             "with token_ids records to audit (capture with the token_ids hook)")
        chosen = sample_requests(token_entries, 8 if requests is None else requests, seed)
    return {pair: catalog.find_records(model_id, request_id=pair[1], run_id=pair[0]) for pair in chosen}


def new_report(model_id: str, model_name: str, seed: int, chosen: tuple[tuple[str, str], ...],
               checks: Sequence[AuditCheck], kind: str, *, audited_at: float,
               audit_id: str | None = None) -> AuditReport:
    """The report of an audit that checked ``chosen`` (a fresh id unless given). ``audited_at``:
    when the audit started, before it read the catalog — its rows' stamp, so that a deletion
    decided while it ran hides them (docs/catalog-protocol.md)."""
    kinds = ", ".join(dict.fromkeys(c.tolerance for c in checks)) or kind
    return AuditReport(audit_id or new_audit_id(), model_id, model_name, seed, kinds, audited_at, chosen,
                       tuple(checks))


def new_audit_id() -> str:
    return f"audit-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"


def vllm_requests(catalog: Any, entries: dict[tuple[str, str], list[RecordEntry]]) -> set[tuple[str, str]]:
    """Which of the ``(run, request)`` pairs (``entries``: their records) a vLLM capture wrote:
    a record in a pack whose writer id starts with ``dmi.capture.VLLM_WRITER_PREFIX``. One
    query of the catalog's packs table for all of them."""
    from dmi.capture import VLLM_WRITER_PREFIX

    pack_ids = sorted({e.pack_id for es in entries.values() for e in es})
    if not pack_ids:
        return set()
    rows = catalog.sql(f"SELECT DISTINCT pack_id FROM {catalog.tables['packs']} "
                       "WHERE pack_id IN %(ids)s AND startsWith(writer_id, %(prefix)s)",
                       {"ids": tuple(pack_ids), "prefix": VLLM_WRITER_PREFIX}).column("pack_id").to_pylist()
    vllm_packs = set(rows)
    return {pair for pair, es in entries.items() if any(e.pack_id in vllm_packs for e in es)}


def audit_rows(report: AuditReport) -> list[dict[str, Any]]:
    """The catalog rows of ``report``: one per check (positions ``-1`` for none). The audits
    table has no rank column: a per-rank check's rank leads its ``detail`` ("TP rank 1",
    "TP rank 1: <what failed>")."""
    common = {"audit_id": report.audit_id, "model_id": report.model_id, "model": report.model,
              "seed": report.seed, "audited_at": report.audited_at}
    rows = []
    for c in report.checks:
        row = {**common, **c.as_dict()}
        row["first_diff"] = -1 if c.first_diff is None else c.first_diff
        row["first_fail"] = -1 if c.first_fail is None else c.first_fail
        if c.shard_rank is not None:
            row["detail"] = f"TP rank {c.shard_rank}" + (f": {c.detail}" if c.detail else "")
        rows.append(row)
    return rows


def _require_known(catalog: Any, model_id: str, run_id: str | None) -> None:
    """Raise ``RecordNotFoundError`` for a model, or a run of it, the catalog does not hold:
    a typo is not a capture without ``token_ids``."""
    models = catalog.models()
    if model_id not in models:
        known = ", ".join(models[:10]) + (" ..." if len(models) > 10 else "") if models else "none yet"
        raise RecordNotFoundError(f"no model {model_id!r} in the catalog (models: {known})")
    if run_id is not None and run_id not in catalog.runs(model_id):
        raise RecordNotFoundError(f"model {model_id!r} has no run {run_id!r} "
                                  f"(list runs with `dmi runs {shlex.quote(model_id)}`)")


def _named(catalog: Any, model_id: str, run_id: str | None, request_ids: list[str]) -> list[tuple[str, str]]:
    if not request_ids:
        raise InvalidArgumentError("request_ids is empty")
    chosen = []
    for rid in request_ids:
        runs = sorted({e.meta.key.run_id for e in catalog.find_records(model_id, request_id=rid, run_id=run_id)})
        if not runs:
            raise RecordNotFoundError(f"model {model_id!r} has no request {rid!r}"
                                      f"{'' if run_id is None else f' in run {run_id!r}'}")
        if len(runs) > 1:
            raise AuditError(f"request {rid!r} was captured in {len(runs)} runs ({', '.join(runs)}); choose one "
                             "with run_id= (dmi: --run)")
        chosen.append((runs[0], rid))
    return chosen
