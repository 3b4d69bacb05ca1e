"""``store.audit(..., per_rank=...)``: audit a tensor-parallel capture on every rank of its
TP group, each rank with its own shard of the model — for a model too large to re-run
unsharded in one process.

Every rank of the TP group calls the audit with the same arguments. Each chooses the same
requests (the same seeded sample of the same catalog), re-runs them one by one, alone,
through its sharded model — in lockstep, since the sharded forward all-reduces — and
compares the records *it* wrote (``shard_rank`` = its TP rank) with its own re-run: its
shard of every sharded hook (the hooks on its sharded modules see exactly its slice), the
replicated hooks and ``token_ids`` it wrote (rank 0; every rank with
``tp_replicas="all"``). The ranks then exchange their checks, so every rank returns the
same report, and TP rank 0 writes it to the catalog as one audit.

Tolerance: ``batched`` (or ``exact=True``). The re-run is tensor-parallel with the same
split on the same ranks, so the row-parallel partial sums and their all-reduce add in the
capture's order; what differs is only the batch (a left-padded batch vs one request
alone) — the batched-matmul noise of an unsharded audit. A capture that ran each request
alone on the same ranks re-runs bit-identically, so ``exact=True`` is allowed here.

Before anything is re-run the ranks agree (one ``all_gather_object``): if any rank refuses
(a request captured with another TP size, a sharded hook without a record of this rank, a
model that cannot re-run it), every rank raises :class:`AuditError` instead of leaving the
others waiting in the re-run's all-reduce.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dmi._audit import (AuditCheck, AuditReport, ReadRecords, RequestPlan, audit_rows, check_request,
                        choose_requests, new_audit_id, new_report, plan_request, vllm_requests)
from dmi.storage.errors import AuditError, DMIError, InvalidArgumentError
from dmi.storage.records import RecordEntry

__all__ = ["RankGroup", "rank_group", "run_rank_audit"]


@dataclass(frozen=True, slots=True)
class RankGroup:
    """This process's place in the TP group the audit runs over: its ``rank`` of ``size``,
    and the ``group`` (a ``torch.distributed`` process group) the ranks talk over."""

    rank: int
    size: int
    group: Any


def rank_group(model: Any, per_rank: Any) -> RankGroup:
    """The TP group of a per-rank audit: ``per_rank=True`` takes it from the device mesh
    transformers stored on a model it sharded (rank and size as the capture finds them,
    ``dmi.capture.resolve_parallel_ranks``); a ``ProcessGroup`` is the TP group of a model
    sharded by hand (rank and size in that group). Raises :class:`AuditError` outside a TP
    group, :class:`InvalidArgumentError` for another ``per_rank``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise AuditError("a per-rank audit runs in every rank of the tensor-parallel group that holds the model's "
                         "shards (under torchrun, after init_process_group), but torch.distributed is not "
                         "initialized in this process; to audit in one process, omit per_rank and give the full model")
    if per_rank is True:
        tp = _model_tp_group(model)
    elif isinstance(per_rank, dist.ProcessGroup):
        tp = RankGroup(dist.get_rank(per_rank), dist.get_world_size(per_rank), per_rank)
    elif type(per_rank) is int and per_rank == dist.GroupMember.NON_GROUP_MEMBER:  # new_group() outside it
        raise AuditError("this process is not a member of the process group given as per_rank")
    else:
        raise InvalidArgumentError("per_rank must be True (the TP group of a model transformers sharded) or a "
                                   f"torch.distributed ProcessGroup (the TP group of a model sharded by hand), not "
                                   f"{per_rank!r}")
    if tp.size < 2:
        raise AuditError("the TP group of this per-rank audit has one rank: the model is not sharded; audit without "
                         "per_rank")
    return tp


def _model_tp_group(model: Any) -> RankGroup:
    from dmi.capture import resolve_parallel_ranks, tp_mesh_of

    mesh = tp_mesh_of(model)
    if mesh is None:
        raise AuditError("per_rank=True takes the TP group from the device mesh transformers stores on a model it "
                         "sharded (load_tensor_parallel, DistributedConfig(tp_size=...)), and this model has none: "
                         "for a model sharded by hand pass its TP process group (per_rank=group); for an unsharded "
                         "model omit per_rank")
    ranks = resolve_parallel_ranks(model)
    return RankGroup(ranks.tp_rank, ranks.tp_size, mesh.get_group())


def run_rank_audit(catalog: Any, read: ReadRecords, model_id: str, model: Any, per_rank: Any, *, model_name: str,
                   run_id: str | None, requests: int | None, request_ids: Sequence[str] | None, seed: int,
                   exact: bool, record: bool) -> AuditReport:
    """This rank's part of a per-rank audit (see the module docstring); every rank returns
    the report of every rank's checks, and TP rank 0 records it."""
    tp = rank_group(model, per_rank)
    kind = "exact" if exact else "batched"
    started = time.time()  # before anything is read: a deletion decided while it runs hides it
    plans: list[RequestPlan] = []
    problem: DMIError | None = None
    try:
        entries = choose_requests(catalog, model_id, run_id, requests, request_ids, seed)
        _refuse_vllm(catalog, entries)
        plans = [_rank_plan(model, pair, es, read, kind, tp) for pair, es in entries.items()]
    except DMIError as exc:  # told to every rank before it is raised here: none is left waiting
        problem = exc
    chosen = tuple((p.run, p.request_id) for p in plans)
    audit_id, audited_at = _agree(tp, problem, chosen, started)
    checks: list[AuditCheck] = []
    error: DMIError | None = None
    for plan in plans:
        try:
            checks.extend(_check_on_rank(plan, model, read, tp))
        except DMIError as exc:  # keep re-running in lockstep; raised once every rank is done
            error = error or exc
    everyone = _exchange(tp, checks, error)
    report = new_report(model_id, model_name, seed, chosen, everyone, kind, audit_id=audit_id, audited_at=audited_at)
    if record and tp.rank == 0:
        catalog.record_audit(audit_rows(report))
    return report


def _refuse_vllm(catalog: Any, entries: dict[tuple[str, str], list[RecordEntry]]) -> None:
    vllm = sorted(vllm_requests(catalog, entries))
    if vllm:
        raise AuditError(f"request {vllm[0][1]} (run {vllm[0][0]}) was captured by vLLM, whose ranks are its own "
                         "workers: audit it without per_rank, against the Hugging Face model of the same weights")


def _rank_plan(model: Any, pair: tuple[str, str], entries: list[RecordEntry], read: ReadRecords, kind: str,
               tp: RankGroup) -> RequestPlan:
    """The plan of one request on this rank; refuses a request this rank cannot audit."""
    run, rid = pair
    sizes = sorted({e.meta.key.tp_size for e in entries})
    if sizes != [tp.size]:
        hint = "audit it without per_rank" if sizes == [1] else "audit it with the model sharded as it was captured"
        raise AuditError(f"request {rid} (run {run}) was captured with TP size {'/'.join(map(str, sizes))} but the "
                         f"model of this per-rank audit is sharded {tp.size} ways: {hint}")
    plan = plan_request(model, run, rid, entries, read, kind)
    lacking = [f"{hook}@{layer}" for (hook, layer), group in sorted(plan.groups.items())
               if _sharded(group) and not any(e.meta.key.shard_rank == tp.rank for e in group)]
    if lacking:
        raise AuditError(f"request {rid} (run {run}) has no records of TP rank {tp.rank} of {tp.size} for "
                         f"{', '.join(lacking)}: that rank captured none of them (left out by tp_ranks=, or it died "
                         "before publishing: run dmi recover); audit without per_rank to see which shards are missing")
    return plan


def _sharded(group: list[RecordEntry]) -> bool:
    return any(e.meta.shard is not None and e.meta.shard.axis >= 0 for e in group)


def _check_on_rank(plan: RequestPlan, model: Any, read: ReadRecords, tp: RankGroup) -> list[AuditCheck]:
    """This rank's checks of one request: the request re-run through this rank's shard
    (every rank re-runs it, whatever it checks), then the records it wrote against it."""
    mine = {key: group for key, group in plan.groups.items() if any(e.meta.key.shard_rank == tp.rank for e in group)}
    owns_tokens = plan.tokens[0].meta.key.shard_rank == tp.rank
    token_check = [dataclasses.replace(plan.token_check, shard_rank=tp.rank)] if owns_tokens else []
    if plan.ids is None:  # the token_ids do not cover the request: no rank re-runs it
        return token_check
    ref = plan.rerun(model, mine)
    return token_check + check_request(plan, ref, read, mine, shard_rank=tp.rank)


def _all_gather(tp: RankGroup, obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * tp.size
    dist.all_gather_object(out, obj, group=tp.group)
    return out


def _agree(tp: RankGroup, problem: DMIError | None, chosen: tuple[tuple[str, str], ...],
           started: float) -> tuple[str, float]:
    """Every rank's refusal (if any) and chosen requests, exchanged before any re-run; raises
    on every rank if one refused or they chose differently. Returns rank 0's audit id and the
    time it ``started`` (the audit's time: taken before it read the catalog)."""
    said = _all_gather(tp, ("" if problem is None else str(problem), chosen, new_audit_id(), started))
    if problem is not None:
        raise problem
    refused = [f"TP rank {r}: {message}" for r, (message, *_) in enumerate(said) if message]
    if refused:
        raise AuditError("the per-rank audit was refused on another rank; " + "; ".join(refused))
    differing = [r for r, (_, theirs, *_) in enumerate(said) if theirs != chosen]
    if differing:
        raise AuditError(f"TP rank(s) {differing} chose other requests than TP rank {tp.rank}: every rank must call "
                         "the per-rank audit with the same arguments on the same catalog")
    return said[0][2], said[0][3]


def _exchange(tp: RankGroup, checks: list[AuditCheck], error: DMIError | None) -> list[AuditCheck]:
    """Every rank's checks, in rank order; raises on every rank if one failed to check."""
    said = _all_gather(tp, ("" if error is None else str(error), [c.as_dict() for c in checks]))
    if error is not None:
        raise error
    failed = [f"TP rank {r}: {message}" for r, (message, _) in enumerate(said) if message]
    if failed:
        raise AuditError("the per-rank audit failed on another rank; " + "; ".join(failed))
    return [AuditCheck(**c) for _, rank_checks in said for c in rank_checks]
