"""``dmi estimate``: what a capture plan will cost, before it runs.

Every size comes from the runtime's own rules, imported, never re-derived: record shapes and
dtypes from the hook catalogue (``HookSpec.record_shape`` / ``dtype``), ring reservations
from the step plan (``StepPlan.hook_bytes``: each hook rounded up to 16 bytes on its own,
``tail(1)`` for the logits ``generate`` materialises), pack limits from the writer
(``DEFAULT_MAX_RECORDS`` / ``DEFAULT_MAX_BYTES``). So the estimate and the ring cannot
disagree; ``tests/test_estimate.py`` checks the raw bytes and record counts against what a
real capture of the same plan stored, byte for byte.

The workload: requests of ``tokens`` prompt tokens each, ``batch`` per forward, no padding.
``new_tokens = 0`` is a scoring pass (phase ``forward``); otherwise ``generate`` with
``new_tokens`` new tokens: a prefill (logits: the last position only) and
``new_tokens - 1`` decode forwards, coalesced into records of up to ``decode_chunk_steps``
consecutive steps (one record per step when ``step_stride > 1``, or for ``attn_pattern``, whose
key axis grows by one a step — up to the layer's sliding window, where the config sets one:
:func:`sliding_windows`).
With ``tp > 1`` the figures are the worst rank's: heads, kv heads (unless fewer than the
ranks: replicated) and the MLP width divided by ``tp``, rounded up.

Stored sizes apply a *measured* compression ratio (:data:`MEASURED_RATIOS`, from the
storage benchmark in ``docs/benchmarks.md``); int64 hooks and dtypes without a measured
ratio are counted raw, and the output says so.

Reference: ``docs/plans.md``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from dmi.storage.errors import InvalidArgumentError, PlanError

__all__ = ["MEASURED_RATIOS", "RATIO_SOURCE", "DECODE_CHUNK_BYTES", "MAX_BATCH", "HookEstimate", "Estimate",
           "estimate_plan", "estimate_plan_file", "rank_geometry", "sliding_windows"]

MEASURED_RATIOS: dict[tuple[str, str], float] = {
    ("split-zstd", "bfloat16"): 1.468,
    ("split-zstd", "float32"): 1.190,
    ("zstd", "bfloat16"): 1.267,
    ("zstd", "float32"): 1.075,
}
"""Raw / stored bytes by (codec, dtype), as measured by :data:`RATIO_SOURCE`."""

RATIO_SOURCE = ("bench/bench_storage.py run of 2026-11-29 (docs/benchmarks.md, Storage): 192 records of "
                "512 x 2048 activation-like values (Gaussian / sqrt(uniform) tails, 8 outlier channels), "
                "default writer, 2-vCPU x86_64 VM; zstd = the run's zstd-1 figure on the same data")

MAX_BATCH = 65_536
"""The largest ``batch`` estimated: the step plan, as the runtime builds it, holds one entry
per request, so the time an estimate takes grows with ``batch`` (and the web page estimates on
every edit). Far above any real batch."""

DECODE_CHUNK_BYTES = 16 << 20
"""The drain's staging bound per (hook, layer) for coalesced decode steps (``Drain``'s
``decode_chunk_bytes`` default; ``tests/test_estimate.py`` pins the two together)."""


@dataclass(frozen=True, slots=True)
class HookEstimate:
    """One hook over all its selected layers, on the worst tensor-parallel rank."""

    hook: str
    layers: tuple[int, ...]  # (-1,) for a global hook
    dtype: str
    bytes_per_token: int  # one layer, one token (attn_pattern: one query x key pair)
    records_per_request: int
    raw_bytes_per_request: int
    ring_bytes_per_step: int  # the batch's prompt step, every layer, as the ring reserves it


@dataclass(frozen=True, slots=True)
class Estimate:
    """What ``dmi estimate`` prints (sizes in bytes)."""

    model: str
    tokens: int
    new_tokens: int
    batch: int
    tp: int
    hooks: tuple[HookEstimate, ...]
    codec: str
    ratio: float | None  # None: no measured ratio for this codec and dtype (stored = raw)
    ratio_source: str
    raw_bytes_per_request: int
    stored_bytes_per_request: int
    records_per_request: int
    tokens_per_request: int  # what the model processes: the prompt and each decode input
    requests_per_million_tokens: float  # captured requests (request_stride applied)
    raw_bytes_per_million_tokens: int
    stored_bytes_per_million_tokens: int
    records_per_million_tokens: int
    packs_per_million_tokens: int
    catalog_rows_per_million_tokens: int
    peak_step_bytes: int
    largest_tensor_bytes: int  # the largest single ring reservation: a (hook, layer) of a step; a request's pattern
    slot_bytes: int
    ring_slots: int

    @property
    def fits_slot(self) -> bool:
        """Whether every (hook, layer) tensor fits one ring slot (a bigger one grows its slot's buffer)."""
        return self.largest_tensor_bytes <= self.slot_bytes

    @property
    def step_fits_ring(self) -> bool:
        """Whether the largest step fits the whole ring (else the model waits on the drain
        thread within that step, up to ``ring.timeout``)."""
        return self.peak_step_bytes <= self.slot_bytes * self.ring_slots

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["hooks"] = [dataclasses.asdict(h) for h in self.hooks]
        d["fits_slot"] = self.fits_slot
        d["step_fits_ring"] = self.step_fits_ring
        return d


def rank_geometry(geometry: Any, tp: int) -> Any:
    """The geometry one tensor-parallel rank sees, for the worst (largest) rank: the axes
    the catalogue marks ``tp_axis`` (heads, kv heads, MLP width) divided by ``tp``, rounded
    up; kv heads fewer than the ranks are replicated, as capture records them."""
    if tp == 1:
        return geometry
    kv = geometry.n_kv_heads
    return dataclasses.replace(geometry, n_heads=-(-geometry.n_heads // tp),
                               n_kv_heads=kv if kv < tp else -(-kv // tp),
                               intermediate=-(-geometry.intermediate // tp))


def _selected(plan: Any, geometry: Any, source: str, config: dict[str, Any] | None) -> dict[str, tuple[int, ...]]:
    """Per hook, the layers captured — ``dmi.capture``'s selection rules on a geometry (and the
    config's sparse layout: ``offered_hooks``)."""
    from dmi._describe import offered_hooks
    from dmi.capture import HOOKS, resolve_hooks

    layers = plan.check_layers(geometry.n_layers, source)
    offered = offered_hooks(geometry, config)
    chosen = {}
    for name in resolve_hooks(list(plan.hooks)):
        if name not in offered:
            if name in plan.hooks:
                raise PlanError(source, "hooks", f"hook {name!r} does not exist on model type "
                                                 f"{geometry.model_type!r}; available: {', '.join(offered)}")
            continue
        chosen[name] = layers if HOOKS[name].per_layer else (-1,)
    if not chosen:
        raise PlanError(source, "hooks", f"selects no hook available on model type {geometry.model_type!r}")
    return chosen


def _raw(spec: Any, g: Any, n: int, kv: int | None = None) -> int:
    return math.prod(spec.record_shape(g, n, kv)) * spec.dtype(g).itemsize


def _prompt_step(g: Any, hooks: dict[str, tuple[int, ...]], batch: int, tokens: int, phase: str) -> Any:
    from dmi.capture import StepPlan

    zeros = [0] * batch
    return StepPlan.build(batch=batch, tokens=tokens, phase=phase, step=0, first_cols=zeros, starts=zeros,
                          kv_pads=zeros, rows=list(range(batch)), request_ids=[str(r) for r in range(batch)],
                          geometry=g, hooks=hooks)


def _step_bytes(step: Any, hook: str, phase: str, kv: int | None = None) -> int:
    """What the ring reserves for one (hook, layer) of a step (logits: the positions the
    model materialises — the last one in ``generate``)."""
    if hook == "logits" and phase in ("prefill", "decode"):
        return step.tail(1).hook_bytes(hook)
    return step.hook_bytes(hook, kv)


@dataclass(frozen=True, slots=True)
class _Workload:
    tokens: int
    new_tokens: int
    batch: int
    prompt_phase: str
    prompt_captured: bool
    decode_steps: tuple[int, ...]  # the captured decode steps (1-based)
    chunked: bool  # consecutive decode steps coalesce into records


def _workload(plan: Any, tokens: int, new_tokens: int, batch: int) -> _Workload:
    s = plan.schedule
    phase = "forward" if new_tokens == 0 else "prefill"
    steps = tuple(d for d in range(1, new_tokens) if (d - 1) % s.step_stride == 0) if "decode" in s.phases else ()
    w = _Workload(tokens, new_tokens, batch, phase, phase in s.phases, steps,
                  plan.decode_chunk_steps > 1 and s.step_stride == 1)
    if not w.prompt_captured and not w.decode_steps:
        raise InvalidArgumentError(
            f"the plan captures nothing of this workload: its phases are {', '.join(s.phases)}, the workload runs "
            f"{phase}" + (" and decode" if new_tokens > 1 else "") + " (--new-tokens 0 is a scoring forward, "
            "1 a prefill alone, N a prefill and N - 1 decode steps)")
    return w


def sliding_windows(config: dict[str, Any] | None, n_layers: int) -> tuple[int | None, ...]:
    """Per layer, the most keys a decode step's attention sees (``None``: all of them). The
    installed ``transformers`` builds the generation cache from the config: a sliding-attention
    layer (``layer_types``, else every layer where ``sliding_window`` is set — Mistral's default
    is 4096) keeps ``sliding_window - 1`` past keys (``DynamicSlidingWindowLayer``; releases
    without it keep every key), so there the decode records of ``attn_pattern`` stop growing.
    Without ``config`` every layer is taken as full."""
    import transformers.cache_utils

    if not config or not hasattr(transformers.cache_utils, "DynamicSlidingWindowLayer"):
        return (None,) * n_layers
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        cfg = AutoConfig.for_model(config["model_type"], **fields)
    except Exception as exc:  # noqa: BLE001 - transformers' validation errors differ by release
        why = " ".join(str(exc).split())
        raise InvalidArgumentError(f"transformers cannot build a {config['model_type']} config from this one "
                                   f"({type(exc).__name__}: {why}); fix the config's fields") from exc
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (window,) * n_layers
    return tuple(window if t == "sliding_attention" else None for t in types[:n_layers])


def _keys(w: _Workload, window: int | None, step: int) -> int:
    """The keys decode step ``step`` attends to on a layer whose cache keeps ``window`` keys."""
    return w.tokens + step if window is None else min(w.tokens + step, window)


def _hook_estimate(name: str, layers: tuple[int, ...], g: Any, w: _Workload, plan: Any, step: Any,
                   windows: tuple[int | None, ...]) -> HookEstimate:
    from dmi.capture import HOOKS

    spec = HOOKS[name]
    pattern = name == "attn_pattern"
    records = raw = 0
    if w.prompt_captured:
        n = 1 if name == "logits" and w.prompt_phase == "prefill" else w.tokens
        records, raw = 1, _raw(spec, g, n, w.tokens if pattern else None)
    records, raw = records * len(layers), raw * len(layers)
    if pattern:
        records += len(w.decode_steps) * len(layers)
        raw += sum(_raw(spec, g, 1, _keys(w, windows[layer], d)) for layer in layers for d in w.decode_steps)
    elif w.decode_steps:
        per_step = _raw(spec, g, 1)
        k = min(plan.decode_chunk_steps, -(-DECODE_CHUNK_BYTES // (w.batch * per_step))) if w.chunked else 1
        records += -(-len(w.decode_steps) // k) * len(layers)
        raw += len(w.decode_steps) * per_step * len(layers)
    ring = _step_bytes(step, name, w.prompt_phase) * len(layers) if w.prompt_captured else 0
    per_token = spec.dtype(g).itemsize * math.prod(spec.feature_shape(g))
    return HookEstimate(name, layers, str(spec.dtype(g)).removeprefix("torch."), per_token, records, raw, ring)


def _decode_tensor_bytes(g: Any, hooks: dict[str, tuple[int, ...]], w: _Workload,
                         windows: tuple[int | None, ...]) -> dict[tuple[str, int], int]:
    """Per (hook, layer), what the ring reserves for the last captured decode step (the largest:
    its attention pattern has the longest key axis — up to the layer's sliding window); empty
    when no decode step is captured."""
    if not w.decode_steps:
        return {}
    step = _prompt_step(g, hooks, w.batch, 1, "decode")
    last = w.decode_steps[-1]
    kv = {(h, layer): _keys(w, windows[layer], last) if layer >= 0 else None
          for h, layers in hooks.items() for layer in layers}
    sizes = {key: _step_bytes(step, key[0], "decode", key[1]) for key in {(h, k) for (h, _), k in kv.items()}}
    return {(h, layer): sizes[(h, k)] for (h, layer), k in kv.items()}  # a pattern's bytes: once per key count


def _largest_reservation(per_hook: tuple[HookEstimate, ...], decode: dict[tuple[str, int], int], batch: int) -> int:
    """The largest single region the ring reserves: one (hook, layer) of the prompt step or the
    last captured decode step — but ``attn_pattern`` reserves one region per request
    (``StepPlan.hook_bytes``), all alike here (no padding), so its region is the step's ÷ ``batch``."""
    def region(hook: str, step_bytes: int) -> int:
        return step_bytes // batch if hook == "attn_pattern" else step_bytes

    return max([*(region(h.hook, h.ring_bytes_per_step // len(h.layers)) for h in per_hook),
                *(region(h, b) for (h, _), b in decode.items())])


def _peak_step_bytes(decode: dict[tuple[str, int], int], prompt: int) -> int:
    """The largest step the ring must hold: the prompt step, or the last captured decode step."""
    return max(prompt, sum(decode.values()))


def _ratio(codec: str, hooks: tuple[HookEstimate, ...]) -> float | None:
    if codec == "raw":
        return 1.0
    dtypes = {h.dtype for h in hooks if h.dtype != "int64"}
    ratios = {MEASURED_RATIOS.get((codec, dt)) for dt in dtypes}
    return ratios.pop() if len(ratios) == 1 and None not in ratios else None


def estimate_plan(plan: Any, geometry: Any, *, model: str, tokens: int = 512, new_tokens: int = 0, batch: int = 1,
                  tp: int = 1, source: str = "<plan>", config: dict[str, Any] | None = None) -> Estimate:
    """The cost of ``plan`` on a model of ``geometry`` for the workload described above;
    ``config`` (the model's config dict) tells an MoE model's dense layers from its sparse ones."""
    from dmi.storage import DEFAULT_CODEC, DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS

    for name, value, least in (("tokens", tokens, 1), ("new_tokens", new_tokens, 0), ("batch", batch, 1),
                               ("tp", tp, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidArgumentError(f"{name} must be an integer >= {least}, got {value!r}")
    if batch > MAX_BATCH:
        raise InvalidArgumentError(f"batch must be at most {MAX_BATCH:,} requests per forward, got {batch:,}")
    g = rank_geometry(geometry, tp)
    hooks = _selected(plan, geometry, source, config)
    w = _workload(plan, tokens, new_tokens, batch)
    step = _prompt_step(g, hooks, batch, tokens, w.prompt_phase)
    patterns = "attn_pattern" in hooks and bool(w.decode_steps)
    windows = sliding_windows(config, geometry.n_layers) if patterns else (None,) * geometry.n_layers
    per_hook = tuple(_hook_estimate(h, layers, g, w, plan, step, windows) for h, layers in hooks.items())
    codec = plan.codec or DEFAULT_CODEC
    ratio = _ratio(codec, per_hook)
    raw = sum(h.raw_bytes_per_request for h in per_hook)
    stored = sum(h.raw_bytes_per_request / (ratio if ratio and h.dtype != "int64" else 1.0) for h in per_hook)
    records = sum(h.records_per_request for h in per_hook)
    per_request_tokens = tokens + max(new_tokens - 1, 0)
    requests = 1e6 / per_request_tokens / plan.schedule.request_stride
    records_m = math.ceil(records * requests)
    stored_m = math.ceil(stored * requests)
    packs_m = max(1, math.ceil(records_m / DEFAULT_MAX_RECORDS), math.ceil(stored_m / DEFAULT_MAX_BYTES))
    prompt_ring = sum(h.ring_bytes_per_step for h in per_hook)
    decode = _decode_tensor_bytes(g, hooks, w, windows)
    return Estimate(
        model=model, tokens=tokens, new_tokens=new_tokens, batch=batch, tp=tp, hooks=per_hook, codec=codec,
        ratio=ratio, ratio_source="raw bytes: exact" if codec == "raw" else RATIO_SOURCE,
        raw_bytes_per_request=raw, stored_bytes_per_request=math.ceil(stored), records_per_request=records,
        tokens_per_request=per_request_tokens, requests_per_million_tokens=requests,
        raw_bytes_per_million_tokens=math.ceil(raw * requests), stored_bytes_per_million_tokens=stored_m,
        records_per_million_tokens=records_m, packs_per_million_tokens=packs_m,
        catalog_rows_per_million_tokens=records_m + packs_m,
        peak_step_bytes=_peak_step_bytes(decode, prompt_ring),
        largest_tensor_bytes=_largest_reservation(per_hook, decode, batch),
        slot_bytes=plan.ring.slot_bytes, ring_slots=plan.ring.slots,
    )


def estimate_plan_file(path: str, *, model: str | None = None, dtype: str | None = None,
                       home: str | os.PathLike[str] | None = None, **workload: int) -> Estimate:
    """Load the plan at ``path``, read its model's geometry from the config alone (``model``
    overrides the plan's; ``home``: where a real model is cached, see ``read_model_config``),
    and estimate ``workload`` (``tokens``, ``new_tokens``, ``batch``, ``tp``)."""
    from dmi._describe import model_geometry, read_model_config
    from dmi._plan_file import load_plan

    plan = load_plan(path)
    name = model or plan.model
    if name is None:
        raise PlanError(path, "model", "the plan names no model; add `model:` or give --model DIR|config.json|NAME")
    where, config = read_model_config(name, home=home)
    geometry = model_geometry(config, where=where, dtype=dtype)
    return estimate_plan(plan, geometry, model=name, source=path, config=config, **workload)
