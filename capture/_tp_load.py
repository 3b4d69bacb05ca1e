"""Loading a model sharded by transformers' own tensor parallelism, GQA included.

``from_pretrained(path, distributed_config=DistributedConfig(tp_size=n))`` shards q/k/v
column-wise by heads. With one key/value head and several ranks the k/v projections cannot be
cut: they need transformers' ``"replicate"`` plan,
and each attention module's ``num_key_value_groups`` (query heads per kv head, used to
repeat k/v before attention) must then count this rank's query heads, not the model's —
otherwise attention repeats k/v to the model's head count and fails (or, on some paths,
attends with the wrong heads). :func:`load_tensor_parallel` does both; with the records'
catalogue rule (``HookSpec.replicated``) the k/v records then say they are replicated.
"""

from __future__ import annotations

from dmi.storage.errors import InvalidArgumentError

__all__ = ["load_tensor_parallel", "replicated_kv_plan"]

_KV_PROJECTIONS = ("model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj")


def replicated_kv_plan(config, tp_size: int) -> dict[str, str] | None:
    """The TP plan override a model needs on ``tp_size`` ranks: k/v replicated when it has
    one key/value head and several ranks, else ``None`` (the model's own plan).

    Between one head and ``tp_size`` (2 kv heads on 4 ranks) neither works: cut, a rank has
    no whole kv head; replicated, each rank would hold every kv head while its query heads
    need only one of them, and attention pairs them wrongly (a wrong model, captured as
    right). So do kv heads that ``tp_size`` does not divide (3 on 2 ranks): transformers
    cuts the k/v projections mid-head and attention fails with a bare shape error. Both are
    refused with :class:`InvalidArgumentError`."""
    n_kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1)
    if n_kv >= tp_size and n_kv % tp_size:
        raise InvalidArgumentError(
            f"{n_kv} key/value heads cannot be split evenly over {tp_size} ranks: a rank would hold part of a "
            f"kv head and the model fails in attention; use a tp_size that divides {n_kv}"
        )
    if n_kv >= tp_size:
        return None
    if n_kv > 1:
        raise InvalidArgumentError(
            f"{n_kv} key/value heads cannot be split over {tp_size} ranks, and replicating them would pair "
            f"query heads with the wrong kv heads; use a tp_size of at most {n_kv}"
        )
    return {name: "replicate" for name in _KV_PROJECTIONS}


def load_tensor_parallel(path, tp_size: int, **from_pretrained_kwargs):
    """``AutoModelForCausalLM.from_pretrained(path)`` sharded ``tp_size`` ways by transformers
    (``torch.distributed`` must be initialised, one process per rank), with k/v replicated
    and ``num_key_value_groups`` fixed for a single kv head; more kv heads than one but fewer
    than ``tp_size``, and kv heads ``tp_size`` does not divide, are refused
    (:func:`replicated_kv_plan`)."""
    import transformers
    from transformers.distributed import DistributedConfig

    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidArgumentError(f"tp_size must be an int >= 1, got {tp_size!r}")
    config = transformers.AutoConfig.from_pretrained(path)
    n_heads = config.num_attention_heads
    if n_heads % tp_size:
        raise InvalidArgumentError(f"{n_heads} attention heads cannot be split over {tp_size} ranks")
    plan = replicated_kv_plan(config, tp_size)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=tp_size, tp_plan=plan), **from_pretrained_kwargs)
    if plan is not None:
        groups = (n_heads // tp_size) // config.num_key_value_heads
        for module in model.modules():
            if hasattr(module, "num_key_value_groups"):
                module.num_key_value_groups = groups
    return model
