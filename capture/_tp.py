"""Which tensor-parallel shard this process captures: its TP rank and the TP degree.

The rank is the process's position in the *tensor-parallel* group, not its global
``torch.distributed`` rank: under data or pipeline parallelism the two differ (with
``dp=2, tp=2`` global rank 3 holds TP shard 1). In order of precedence it comes from

1. ``tp_rank=`` / ``tp_size=`` the caller passes (either may be given alone);
2. the TP device mesh transformers stored on a model it sharded
   (``distributed_config=DistributedConfig(tp_size=...)``): transformers 5.x keeps a mesh
   manager (``model._mesh_manager.get_mesh("tp")``) and the ``("pp", "fsdp", "tp")`` mesh
   (``model._device_mesh``), or — through the legacy tensor-parallel API — a 1-D TP mesh in
   ``model._device_mesh``. These are transformers' private attributes, read here because
   the public ``model.tp_size`` gives the degree only, never the rank;
3. otherwise rank 0 of 1 (an unsharded model).

A model whose ``tp_size`` says it is sharded but whose TP mesh cannot be found is refused
rather than guessed: pass ``tp_rank=`` and ``tp_size=``.

The data- and pipeline-parallel ranks (recorded in every record, so that the replicas of a
TP x DP run stay apart) come from ``dp_rank=`` / ``pp_rank=`` when given, else from the
coordinates of this process in transformers' named device mesh (``pp``; ``dp_replicate``,
``dp``, ``fsdp``, ``dp_shard`` flattened in that order), else 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmi.storage.errors import InvalidArgumentError

__all__ = ["TensorParallelRank", "ParallelRanks", "resolve_tp", "resolve_parallel_ranks"]

_DP_DIMS = ("dp_replicate", "dp", "fsdp", "dp_shard")
"""Mesh dimensions that hold data-parallel replicas, outermost first."""


@dataclass(frozen=True, slots=True)
class TensorParallelRank:
    """This process's shard: ``rank`` in ``0 .. size - 1`` of a ``size``-way TP group."""

    rank: int
    size: int


@dataclass(frozen=True, slots=True)
class ParallelRanks:
    """Where this process sits in a parallel run: its TP shard, DP replica and PP stage."""

    tp_rank: int
    tp_size: int
    dp_rank: int = 0
    pp_rank: int = 0


def resolve_parallel_ranks(model, *, tp_rank: int | None = None, tp_size: int | None = None,
                           dp_rank: int | None = None, pp_rank: int | None = None) -> ParallelRanks:
    """TP rank and size (:func:`resolve_tp`), then DP and PP ranks (see the module docstring).

    Raises :class:`InvalidArgumentError` for a rank that is not an int >= 0."""
    tp = resolve_tp(model, tp_rank, tp_size)
    _check_int("dp_rank", dp_rank, minimum=0)
    _check_int("pp_rank", pp_rank, minimum=0)
    coords = _mesh_coordinates(model) if dp_rank is None or pp_rank is None else {}
    if dp_rank is None:
        dp_rank = _flat_dp_rank(coords)
    if pp_rank is None:
        pp_rank = coords.get("pp", (0, 1))[0]
    return ParallelRanks(tp.rank, tp.size, dp_rank, pp_rank)


def _mesh_coordinates(model) -> dict[str, tuple[int, int]]:
    """``{dim name: (this process's index, dim size)}`` in the model's named dense mesh."""
    manager = getattr(model, "_mesh_manager", None)
    mesh = getattr(manager, "_dense_mesh", None) if manager is not None else None
    if mesh is None:
        mesh = getattr(model, "_device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) if mesh is not None else None
    if not names or not set(names) & {"pp", *_DP_DIMS}:  # a TP-only mesh: rank 0 of every other kind
        return {}
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this process is not in the mesh
        return {}
    return {name: (int(index), int(mesh.size(dim))) for dim, (name, index) in enumerate(zip(names, coordinate))}


def _flat_dp_rank(coords: dict[str, tuple[int, int]]) -> int:
    rank = 0
    for name in _DP_DIMS:
        index, size = coords.get(name, (0, 1))
        rank = rank * size + index
    return rank


def resolve_tp(model, tp_rank: int | None = None, tp_size: int | None = None) -> TensorParallelRank:
    """The TP rank and size for ``model`` (see the module docstring for the precedence).

    Raises :class:`InvalidArgumentError` for a rank or size that is not an int in range, and
    for a sharded model whose TP mesh cannot be found when ``tp_rank`` is not given.
    """
    _check_int("tp_rank", tp_rank, minimum=0)
    _check_int("tp_size", tp_size, minimum=1)
    mesh = None if tp_rank is not None and tp_size is not None else tp_mesh_of(model)
    if mesh is not None:
        rank = tp_rank if tp_rank is not None else int(mesh.get_local_rank())
        size = tp_size if tp_size is not None else int(mesh.size())
    else:
        size = tp_size if tp_size is not None else int(getattr(model, "tp_size", None) or 1)
        if tp_rank is None and size > 1:
            raise InvalidArgumentError(
                f"the model is sharded {size} ways for tensor parallelism but its TP device mesh was not "
                "found, so this process's TP rank is unknown; pass tp_rank= and tp_size= to attach"
            )
        rank = tp_rank if tp_rank is not None else 0
    if rank >= size:
        raise InvalidArgumentError(f"tp_rank must be below tp_size, got tp_rank={rank} with tp_size={size}")
    return TensorParallelRank(rank, size)


def tp_mesh_of(model):
    """The 1-D tensor-parallel ``DeviceMesh`` transformers stored on ``model``, or ``None``."""
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        return manager.get_mesh("tp")
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        return mesh["tp"]
    return mesh if mesh.ndim == 1 and not names else None


def _check_int(name: str, value, *, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
