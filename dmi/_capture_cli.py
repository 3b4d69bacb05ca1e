"""``dmi capture``: load a model, run prompts through it under capture, report what was stored."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from dmi.storage.errors import InvalidArgumentError

__all__ = ["run_capture", "stored_totals", "apply_plan"]

_PLAN_FLAGS = {"hooks": "resid_post", "layers": None, "phases": "prefill,decode", "step_stride": 1,
               "request_stride": 1, "warmup": 0, "model_id": None}
"""``dmi capture`` flags a plan file also sets, with their defaults: given with ``--plan``, refused.
The parser leaves them ``None`` so that a flag given explicitly (even with its default value)
is told apart from one left out; :func:`apply_plan` fills in the defaults."""


def apply_plan(args: argparse.Namespace) -> Any:
    """Load ``--plan`` (``None`` without it): refuse flags the plan also sets (any given at all),
    take the model and the store location from the plan where the command line leaves them
    out. Flags left out then take their defaults (``_PLAN_FLAGS``), with a plan or without."""
    from dmi._plan_file import load_plan

    if args.plan is None:
        if args.model is None:
            raise InvalidArgumentError("no model: give --model DIR|NAME, or --plan FILE with a model")
        _fill_defaults(args)
        return None
    plan = load_plan(args.plan)
    both = [name for name in _PLAN_FLAGS if getattr(args, name) is not None]
    if both:
        flags = ", ".join("--" + name.replace("_", "-") for name in both)
        raise InvalidArgumentError(f"{flags} given with --plan; set them in the plan file {args.plan}")
    if args.model is None:
        if plan.model is None:
            raise InvalidArgumentError(f"no model: the plan {args.plan} names none; give --model DIR|NAME")
        args.model = plan.model
    if not any((args.home, args.catalog, args.packs)):
        args.home, args.catalog, args.packs = plan.store.home, plan.store.catalog, plan.store.packs
    _fill_defaults(args)
    return plan


def _fill_defaults(args: argparse.Namespace) -> None:
    """Give each plan-settable flag the command line left out (``None``) its default."""
    for name, default in _PLAN_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def stored_totals(descriptors: Sequence[Any]) -> dict[str, int]:
    """Records, packs and bytes (raw payload, stored payload, whole pack files) of sealed packs."""
    records = [entry for d in descriptors for entry in d.records]
    return {
        "packs": len(descriptors),
        "records": len(records),
        "raw_bytes": sum(e.meta.raw_size for e in records),
        "stored_bytes": sum(e.payload.length for e in records),
        "pack_bytes": sum(d.size for d in descriptors),
    }


def run_capture(
    store: Any,
    args: argparse.Namespace,
    prompts: Sequence[str],
    *,
    layers: Any,
    progress: Callable[[int], Any],
    status: Callable[[str], AbstractContextManager[Any]],
    plan: Any = None,
) -> dict[str, Any]:
    """Capture ``prompts`` through the model ``args.model`` into ``store``; returns ids and totals.

    ``--max-new-tokens 0`` runs one scoring pass per batch (phase ``forward``); otherwise
    ``generate`` runs greedily and ``--phases`` chooses prefill and/or decode. With a
    ``plan`` (``--plan``), the plan gives hooks, layers, schedule, ids, codec and ring.
    ``status(text)`` shows what happens while torch and the model load (seconds to
    minutes, with no countable progress); ``progress(total)`` then counts prompts. The
    model's tokenizer goes to capture: each request keeps its prompt text and token strings.
    A real model (``smollm2``) is cached in ``store.home``, the home the command writes to.
    """
    if args.max_new_tokens < 0:
        raise InvalidArgumentError("--max-new-tokens must be at least 0")
    if args.batch_size < 1:
        raise InvalidArgumentError("--batch-size must be at least 1")
    with status(f"loading model {args.model}"):
        import torch

        import dmi
        from dmi._models import load_model, model_progress
        from dmi.capture import Schedule

        scoring = args.max_new_tokens == 0
        phases = ("forward",) if scoring else tuple(p.strip() for p in args.phases.split(",") if p.strip())
        schedule = Schedule(phases=phases, step_stride=args.step_stride,
                            request_stride=args.request_stride, warmup=args.warmup)
        _quiet_transformers()
        loaded = load_model(args.model, attn_implementation=args.attn_implementation, home=store.home,
                            progress=model_progress(quiet=args.quiet))
    tokenizer = loaded.tokenizer
    request_ids: list[str] = []
    options = ({"plan": args.plan} if plan is not None else
               {"hooks": args.hooks, "layers": layers, "model_id": args.model_id, "schedule": schedule})
    with dmi.capture(loaded.model, store=store, tokenizer=tokenizer, **options) as session, \
            progress(len(prompts)) as bar:
        for start in range(0, len(prompts), args.batch_size):
            batch = list(prompts[start:start + args.batch_size])
            enc = tokenizer(batch, return_tensors="pt", padding=True)
            with torch.inference_mode():
                if scoring:
                    result = session.forward(enc["input_ids"], enc["attention_mask"])
                else:
                    result = session.generate(enc["input_ids"], enc["attention_mask"],
                                              max_new_tokens=args.max_new_tokens, do_sample=False,
                                              pad_token_id=tokenizer.pad_token_id)
            request_ids.extend(result.request_ids)
            bar.update(len(batch))
        session.flush()
        published = list(session.published)
        model_id, run_id = session.model_id, session.run_id
    return {"model_id": model_id, "run_id": run_id, "request_ids": request_ids, **stored_totals(published)}


def _quiet_transformers() -> None:
    """HF's own progress bars and advisory logs would interleave with ours; DMI reports progress."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()

