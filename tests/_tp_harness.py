"""Run a function on N tensor-parallel ranks, one spawned process each, from pytest.

No torchrun and no ports: ``torch.multiprocessing`` with the ``spawn`` start method, a
``gloo`` process group initialised through a file in the test's temporary directory, one
torch thread per rank (the machine's cores are shared). Each rank calls
``fn(rank, world, *args)`` — ``fn`` must be importable (a module-level function) — and its
return value comes back through ``torch.save`` in the temporary directory, tensors
included. A rank that raised comes back as :class:`RankFailed` with its traceback; a rank
killed by a signal comes back as its negative exit code (``-9`` for SIGKILL), so a test can
kill a rank on purpose.

Also here: :func:`shard_llama_by_hand`, the hand-made tensor parallelism the tests use
(slices of the projections plus an all-reduce after the row-parallel ones), and the
:class:`~dmi.capture.TPShard` layout that describes it to DMI.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

__all__ = ["RankFailed", "run_ranks", "shard_llama_by_hand", "hand_layout", "AUDIT_GEN", "AUDIT_HOOKS", "AUDIT_SHARDED"]


AUDIT_GEN = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
"""The audit tests' generation: three new tokens, greedy."""
AUDIT_HOOKS = ["token_ids", "resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "attn_out", "mlp_post", "resid_post",
               "logits"]
"""What the audit tests capture on each rank: every hook with token rows, sharded and replicated."""
AUDIT_SHARDED = {"attn_q", "attn_k", "attn_v", "attn_z", "mlp_post"}
"""The hooks of :data:`AUDIT_HOOKS` each rank holds a shard of."""


@dataclass(frozen=True)
class RankFailed:
    """A rank's ``fn`` raised: its traceback."""

    rank: int
    traceback: str


def run_ranks(fn, world: int, workdir, *args, timeout: float = 240.0) -> list:
    """``[result of rank 0, result of rank 1, ...]``: each ``fn(rank, world, *args)``'s return
    value, a :class:`RankFailed`, or the negative exit code of a rank a signal killed.
    Raises ``TimeoutError`` (after killing every rank) if they do not finish in ``timeout``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    init = workdir / "pg-init"
    init.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, world, str(init), str(workdir), args))
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline = _now() + timeout
    for p in procs:
        p.join(max(0.0, deadline - _now()))
    if any(p.is_alive() for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        raise TimeoutError(f"TP ranks did not finish within {timeout} s")
    return [_result(workdir, rank, p.exitcode) for rank, p in enumerate(procs)]


def _now() -> float:
    import time

    return time.monotonic()


def _result(workdir: Path, rank: int, exitcode: int):
    if exitcode < 0:
        return exitcode
    out = workdir / f"rank{rank}.pt"
    if not out.exists():
        return RankFailed(rank, f"exited with code {exitcode} and no result")
    return torch.load(out, weights_only=False)


def _rank_main(fn, rank: int, world: int, init: str, workdir: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - handed to the test, which fails with it
        result = RankFailed(rank, traceback.format_exc())
    torch.save(result, Path(workdir) / f"rank{rank}.pt")
    dist.destroy_process_group()


# ------------------------------------------------------------------------ hand-made TP


class _RowParallelLinear(nn.Module):
    """A row-parallel projection: this rank's input columns, then a sum over the ranks."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, input):  # noqa: A002 - the name nn.Linear uses (DMI's extractor reads it)
        import torch.distributed as dist

        out = nn.functional.linear(input, self.weight)
        dist.all_reduce(out)
        return out


def _column_slice(linear: nn.Linear, rank: int, world: int) -> None:
    block = linear.out_features // world
    rows = slice(rank * block, (rank + 1) * block)
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = block


def _row_parallel(linear: nn.Linear, rank: int, world: int) -> _RowParallelLinear:
    block = linear.in_features // world
    return _RowParallelLinear(linear.weight.detach()[:, rank * block : (rank + 1) * block].clone())


def shard_llama_by_hand(model, rank: int, world: int):
    """Cut a Llama-like model (kv heads divisible by ``world``) into this rank's shard, in
    place: q/k/v and gate/up column-parallel (contiguous blocks of heads / features),
    o_proj and down_proj row-parallel followed by an all-reduce. Returns ``model``."""
    cfg = model.config
    if cfg.num_key_value_heads % world or cfg.num_attention_heads % world or cfg.intermediate_size % world:
        raise ValueError("this hand-made cut needs heads, kv heads and intermediate size divisible by world")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _column_slice(proj, rank, world)
        attn.o_proj = _row_parallel(attn.o_proj, rank, world)
        mlp.down_proj = _row_parallel(mlp.down_proj, rank, world)
    return model


def hand_layout(config, rank: int, world: int) -> dict:
    """The ``tp_layout=`` that tells DMI how :func:`shard_llama_by_hand` cut the model."""
    from dmi.capture import TPShard

    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    return {
        "attn_q": TPShard(axis=1, offset=rank * heads // world, full=heads),
        "attn_k": TPShard(axis=1, offset=rank * kv // world, full=kv),
        "attn_v": TPShard(axis=1, offset=rank * kv // world, full=kv),
        "attn_z": TPShard(axis=1, offset=rank * heads // world, full=heads),
        "mlp_post": TPShard(axis=1, offset=rank * inter // world, full=inter),
    }
