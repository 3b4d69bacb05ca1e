"""The audit's reference: one request re-run alone, observed by plain PyTorch forward hooks.

The request's own captured tokens (prompt, then every token fed at a decode step) go
through the model as batch 1: no padding, no other request, no DMI capture session, ring,
plan, drain, pack or catalog in the path. The hooks sit on the same modules DMI hooks
(``dmi.capture.resolve_architecture(...).taps``) and keep what each module saw, so the
reference differs from the capture only in what the capture did to it.

A generate capture is re-run the way ``generate`` ran it: the prompt in one forward, then
one forward per decode token over a KV cache, logits only at the last position. A forward
capture is re-run as one forward over every token.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from dmi.storage.errors import AuditError

__all__ = ["StepChunk", "Reference", "rerun_alone"]


@dataclass(frozen=True, slots=True)
class StepChunk:
    """What one hook (at one layer) produced in one re-run forward.

    ``end`` is the position after the forward's last token; a chunk with ``t`` token rows
    covers ``[end - t, end)`` (a module may materialise only the last positions, e.g. the
    LM head under ``logits_to_keep``). ``layout`` is the catalogue layout: ``"bt"`` and
    ``"flat"`` tensors are ``[t, ...]`` here, ``"pattern"`` ones ``[heads, q, kv]``.
    """

    end: int
    layout: str
    tensor: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.tensor.shape[1] if self.layout == "pattern" else self.tensor.shape[0]

    @property
    def start(self) -> int:
        return self.end - self.n_tokens


@dataclass(frozen=True, slots=True)
class Reference:
    """Every chunk of a re-run, by ``(hook, layer)``, in forward order."""

    chunks: dict[tuple[str, int], list[StepChunk]]

    def span(self, hook: str, layer: int, start: int, n: int) -> torch.Tensor:
        """The reference rows of positions ``[start, start + n)`` (``[n, ...]``), or for
        ``attn_pattern`` the one chunk whose query positions are exactly those."""
        chunks = self.chunks.get((hook, layer), [])
        if hook == "attn_pattern":
            for c in chunks:
                if c.start == start and c.n_tokens == n:
                    return c.tensor
            raise AuditError(f"the re-run has no {hook} layer {layer} step covering positions [{start}, {start + n})")
        parts = []
        for c in chunks:
            lo, hi = max(start, c.start), min(start + n, c.end)
            if lo < hi:
                parts.append(c.tensor[lo - c.start: hi - c.start])
        got = sum(p.shape[0] for p in parts)
        if got != n:
            raise AuditError(f"the re-run materialised {got} of the {n} positions [{start}, {start + n}) "
                             f"of {hook} layer {layer}")
        return torch.cat(parts)


def rerun_alone(model: Any, tokens: torch.Tensor, prompt_len: int, *, generate: bool,
                wanted: dict[str, tuple[int, ...]]) -> Reference:
    """Run ``tokens`` (``[T]``) through ``model`` alone and keep what ``wanted`` names.

    ``generate``: re-run as generation (``prompt_len`` tokens of prefill, then one decode
    forward per remaining token); otherwise one scoring forward over all ``T`` tokens.
    """
    from dmi.capture import resolve_architecture

    arch = resolve_architecture(model)
    taps = arch.taps({h: layers for h, layers in wanted.items() if h != "token_ids"})
    chunks: dict[tuple[str, int], list[StepChunk]] = {}
    end = [0]

    def keep(emissions, args, kwargs, output):
        for em in emissions:
            x = em.extract(args, kwargs, output)
            if x is None:
                raise AuditError(f"the re-run's {em.hook} layer {em.layer} module produced no tensor "
                                 "(attn_pattern needs eager attention)")
            x = x.detach().to("cpu", copy=True)
            x = x[0] if em.layout in ("bt", "pattern") else x
            chunks.setdefault((em.hook, em.layer), []).append(StepChunk(end[0], em.layout, x))

    handles = []
    for tap in taps:
        if tap.kind == "pre":
            handles.append(tap.module.register_forward_pre_hook(
                lambda m, a, k, ems=tap.emissions: keep(ems, a, k, None), with_kwargs=True))
        else:
            handles.append(tap.module.register_forward_hook(
                lambda m, a, k, o, ems=tap.emissions: keep(ems, a, k, o), with_kwargs=True))
    cache = _new_cache(model) if generate else None
    try:
        with torch.inference_mode():
            for lo, hi in _forwards(len(tokens), prompt_len, generate):
                end[0] = hi
                model(**_inputs(model, tokens, lo, hi, cache))
    finally:
        for h in handles:
            h.remove()
    return Reference(chunks)


def _forwards(total: int, prompt_len: int, generate: bool) -> list[tuple[int, int]]:
    if not generate:
        return [(0, total)]
    return [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, total)]


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _inputs(model: Any, tokens: torch.Tensor, lo: int, hi: int, cache: Any) -> dict:
    """The keyword arguments of one re-run forward (those ``generate`` would pass, batch 1)."""
    device = next(model.parameters()).device
    ids = tokens[lo:hi].to(device).unsqueeze(0)
    if cache is None:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones((1, hi), dtype=torch.long, device=device),
        "position_ids": torch.arange(lo, hi, device=device).unsqueeze(0),
        "cache_position": torch.arange(lo, hi, device=device),
        "use_cache": True,
    }
    accepted = inspect.signature(model.forward).parameters
    inputs["cache" if "cache" in accepted else "past_key_values"] = cache
    if "logits_to_keep" in accepted:
        inputs["logits_to_keep"] = 1
    return inputs
