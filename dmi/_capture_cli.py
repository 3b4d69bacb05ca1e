"""``dmi capture``: load a model, run prompts through it under capture, report what was stored."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence
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
    out. Flags left out then take their defaults (``_PLAN_FLAGS``), with a plan or without.
    Everything the command line alone can get wrong is refused here, before a store is
    opened or a model loaded (:func:`_check_run`)."""
    from dmi._plan_file import load_plan

    if args.plan is None:
        if args.model is None:
            raise InvalidArgumentError("no model: give --model DIR|NAME, or --plan FILE with a model")
        _check_run(args, None)
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
    _check_run(args, plan)
    _fill_defaults(args)
    return plan


def _check_run(args: argparse.Namespace, plan: Any) -> None:
    """Refuse counts out of range, a blank ``--model-id`` (a plan refuses a blank ``model_id``
    the same way) and phases that capture nothing of the run ``--max-new-tokens`` asks for:
    without this a ``--phases forward`` generation, or a plan of ``[prefill, decode]`` under
    ``--max-new-tokens 0``, exits 0 having stored no record."""
    if args.max_new_tokens < 0:
        raise InvalidArgumentError("--max-new-tokens must be at least 0")
    if args.batch_size < 1:
        raise InvalidArgumentError("--batch-size must be at least 1")
    if args.model_id is not None and not args.model_id.strip():
        raise InvalidArgumentError("--model-id is blank (only whitespace); give a model id with a visible "
                                   "character, or leave --model-id out")
    if plan is not None:
        _check_phases(plan.schedule.phases, args.max_new_tokens,
                      f"the plan {args.plan} captures phases {', '.join(plan.schedule.phases)}", "schedule.phases")
    elif args.phases is not None:
        _check_phases(_phase_names(args.phases), args.max_new_tokens, f"--phases {args.phases}", "--phases")


def _phase_names(text: str) -> tuple[str, ...]:
    """``--phases`` as the names it lists (``"prefill, decode"`` → ``("prefill", "decode")``)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _run_phases(max_new_tokens: int) -> tuple[str, ...]:
    """The phases a run of ``--max-new-tokens N`` produces: a scoring forward for 0, a prefill
    alone for 1, a prefill and ``N - 1`` decode steps otherwise."""
    return ("forward",) if max_new_tokens == 0 else ("prefill",) if max_new_tokens == 1 else ("prefill", "decode")


def _check_phases(selected: tuple[str, ...], max_new_tokens: int, what: str, where: str) -> None:
    """Refuse a selection of (known) phases that shares none with the run's; unknown names are
    left to ``Schedule``, which names the valid ones."""
    from dmi.storage.records import PHASES

    produced = _run_phases(max_new_tokens)
    if not selected or not set(selected) <= set(PHASES) or set(selected) & set(produced):
        return
    run = ("one scoring pass (phase forward)" if max_new_tokens == 0 else
           f"{'a prefill alone' if max_new_tokens == 1 else 'a prefill and decode steps'} "
           f"(phases {', '.join(produced)})")
    raise InvalidArgumentError(
        f"{what}, none of which this run produces: --max-new-tokens {max_new_tokens} runs {run}; "
        f"change {where} or --max-new-tokens (0: a scoring pass, 1: a prefill, N: a prefill and N - 1 "
        "decode steps)")


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

    ``args`` as :func:`apply_plan` left them. ``--max-new-tokens 0`` runs one scoring pass
    per batch (phase ``forward``); otherwise ``generate`` runs greedily and ``--phases``
    chooses prefill and/or decode. With a ``plan`` (``--plan``), the plan gives hooks,
    layers, schedule, ids, codec and ring. ``status(text)`` shows what happens while torch
    and the model load (seconds to minutes, with no countable progress); ``progress(total)``
    then counts prompts. The model's tokenizer goes to capture: each request keeps its
    prompt text and token strings. A real model (``smollm2``) is cached in ``store.home``,
    the home the command writes to. Every prompt is tokenized and checked before the first
    forward (:func:`_encode`), so a refused prompt leaves no earlier batch stored, and a
    schedule that keeps no step of the run is refused before the model loads
    (:func:`_check_schedule`). The request ids returned are those that stored records: one
    the schedule skipped (``request_stride``, ``warmup``) has nothing to show or read.
    """
    _check_prompt_text(prompts)
    _check_schedule(args, len(prompts), plan)
    with status(f"loading model {args.model}"):
        import torch

        import dmi
        from dmi._models import load_model, model_progress
        from dmi.capture import Schedule

        scoring = args.max_new_tokens == 0
        phases = ("forward",) if scoring else _phase_names(args.phases)
        schedule = Schedule(phases=phases, step_stride=args.step_stride,
                            request_stride=args.request_stride, warmup=args.warmup)
        _quiet_transformers()
        loaded = load_model(args.model, attn_implementation=args.attn_implementation, home=store.home,
                            progress=model_progress(quiet=args.quiet))
    tokenizer = loaded.tokenizer
    batches = _encode(tokenizer, prompts, args, _position_limit(loaded.model))
    request_ids: list[str] = []
    options = ({"plan": args.plan} if plan is not None else
               {"hooks": args.hooks, "layers": layers, "model_id": args.model_id, "schedule": schedule})
    with _cli_wording(loaded.model, plan.hooks if plan is not None else args.hooks), \
            dmi.capture(loaded.model, store=store, tokenizer=tokenizer, **options) as session, \
            progress(len(prompts)) as bar:
        for enc in batches:
            with torch.inference_mode():
                if scoring:
                    result = session.forward(enc["input_ids"], enc["attention_mask"])
                else:
                    result = session.generate(enc["input_ids"], enc["attention_mask"],
                                              max_new_tokens=args.max_new_tokens, do_sample=False,
                                              pad_token_id=tokenizer.pad_token_id)
            request_ids.extend(result.request_ids)
            bar.update(len(enc["input_ids"]))
        session.flush()
        published = list(session.published)
        model_id, run_id = session.model_id, session.run_id
    stored = {entry.meta.key.request_id for d in published for entry in d.records}
    return {"model_id": model_id, "run_id": run_id, "request_ids": [r for r in request_ids if r in stored],
            **stored_totals(published)}


def _check_schedule(args: argparse.Namespace, count: int, plan: Any) -> None:
    """Refuse a schedule under which ``count`` prompts store nothing: a warmup of as many model
    forwards as the run makes at most (a batch makes ``max(--max-new-tokens, 1)``; generation
    ending early makes fewer), or one that leaves only forwards of requests the request
    stride skips or of phases not kept. Without this the run exits 0 having stored no record.
    Values out of range and unknown phases are left to ``Schedule``, which refuses them in its
    own words (naming the valid phases)."""
    from dmi.storage.records import PHASES

    s = plan.schedule if plan is not None else args
    if s.step_stride < 1 or s.request_stride < 1 or s.warmup < 0:
        return
    phases = plan.schedule.phases if plan is not None else (
        ("forward",) if args.max_new_tokens == 0 else _phase_names(args.phases))
    if not set(phases) <= set(PHASES):
        return
    per_batch, batches = max(args.max_new_tokens, 1), -(-count // args.batch_size)
    if any(_stores(b, k, args, count, s, phases) for b in range(s.warmup // per_batch, batches)
           for k in range(per_batch)):
        return
    flag = ((lambda name: f"schedule.{name}") if plan is not None else
            (lambda name: "--" + name.replace("_", "-")))
    raise InvalidArgumentError(_nothing_stored(args, count, s, phases, flag, per_batch * batches))


def _nothing_stored(args: argparse.Namespace, count: int, schedule: Any, phases: tuple[str, ...],
                    flag: Callable[[str], str], total: int) -> str:
    """Why :func:`_check_schedule` refuses: the warmup outlasts the run, the request stride keeps
    no request of the batches the warmup leaves, or what is left is of phases (or decode steps)
    not kept; each names the numbers and the flags (or plan fields) to change."""
    from dmi._human import plural

    where = f"the plan {args.plan}: " if args.plan is not None else ""
    batches = -(-count // args.batch_size)
    run = (f"{batches} batch{'' if batches == 1 else 'es'} of up to {args.batch_size} (--batch-size), "
           f"{_batch_forwards(args.max_new_tokens)} each")
    skip = f"{flag('warmup')} {schedule.warmup} skips the first {plural(schedule.warmup, 'model forward')}"
    if schedule.warmup >= total:
        return (f"{where}{skip}, but this run of {plural(count, 'prompt')} makes at most {total} ({run}), "
                f"so nothing would be stored; give {flag('warmup')} below {total}, or more prompts")
    first = schedule.warmup // max(args.max_new_tokens, 1) * args.batch_size + 1
    left = f"request {count}" if first == count else f"requests {first}-{count}"
    if not any(n % schedule.request_stride == 0 for n in range(first - 1, count)):
        return (f"{where}{skip} ({run}), and {flag('request_stride')} {schedule.request_stride} keeps none of the "
                f"requests in the batches left ({left} of {count}), so nothing would be stored; lower "
                f"{flag('warmup')} or {flag('request_stride')}, or give more prompts")
    stride = (f" of a request {flag('request_stride')} {schedule.request_stride} keeps"
              if schedule.request_stride > 1 else "")
    return (f"{where}{skip} of this run's {total} ({run}), and none left is{stride} of a phase {flag('phases')} "
            f"keeps ({', '.join(phases)}{_with_stride(flag, schedule.step_stride)}), so nothing would be stored; "
            f"lower {flag('warmup')} or change {flag('phases')}")


def _stores(batch: int, step: int, args: argparse.Namespace, count: int, schedule: Any,
            phases: tuple[str, ...]) -> bool:
    """Whether step ``step`` (0: the prefill or scoring pass) of batch ``batch`` stores a record
    under ``schedule``, as ``dmi.capture.Schedule`` decides, if the model makes that step."""
    first = batch * args.batch_size
    phase = "forward" if args.max_new_tokens == 0 else "prefill" if step == 0 else "decode"
    return (batch * max(args.max_new_tokens, 1) + step >= schedule.warmup and phase in phases
            and (phase != "decode" or (step - 1) % schedule.step_stride == 0)
            and any(n % schedule.request_stride == 0 for n in range(first, min(first + args.batch_size, count))))


def _batch_forwards(max_new_tokens: int) -> str:
    """The model forwards one batch of a ``--max-new-tokens N`` run makes, in words."""
    if max_new_tokens <= 1:
        return "one forward (a scoring pass)" if max_new_tokens == 0 else "one forward (a prefill)"
    return f"{max_new_tokens} forwards (a prefill and {max_new_tokens - 1} decode steps)"


def _with_stride(flag: Callable[[str], str], step_stride: int) -> str:
    """``"; decode steps 1, 1 + N, ... with --step-stride N"`` when a step stride thins decode steps."""
    if step_stride == 1:
        return ""
    return f"; decode steps 1, {1 + step_stride}, ... with {flag('step_stride')} {step_stride}"


@contextlib.contextmanager
def _cli_wording(model: Any, hooks: Any) -> Iterator[None]:
    """Say what to type where the API's refusal says what to call: ``attn_pattern`` on a model
    loaded without eager attention is ``--attn-implementation eager`` here (a bad argument,
    exit 2), not ``model.set_attn_implementation``. ``hooks`` (what the user typed, on the
    command line or in the plan) names the subject: a TransformerLens alias
    (``blocks.0.attn.hook_pattern``) is named as typed, not only as the DMI hook it stands for."""
    from dmi.storage.errors import AttentionImplementationError

    try:
        yield
    except AttentionImplementationError as exc:
        used = getattr(model.config, "_attn_implementation", None)
        typed = _eager_aliases(hooks)
        subject, leave = ((f"{', '.join(typed)} (DMI hook 'attn_pattern')", ", ".join(typed)) if typed else
                          ("'attn_pattern'", "attn_pattern"))
        hint = "" if typed else " (--hooks all_but_patterns)"
        raise InvalidArgumentError(
            f"{subject} need{'' if len(typed) > 1 else 's'} eager attention, but the model uses {used!r} (which "
            f"never materialises the attention weights); pass --attn-implementation eager, or leave {leave} "
            f"out{hint}") from exc


def _eager_aliases(hooks: Any) -> list[str]:
    """The TransformerLens names in ``hooks`` that stand for a hook needing eager attention —
    empty when a plain name or group selects such a hook, as the API then refuses that first."""
    from dmi.capture import HOOKS, resolve_alias, resolve_hooks

    tokens = " ".join([hooks] if isinstance(hooks, str) else hooks).replace(",", " ").split()
    aliases = {token: resolve_alias(token) for token in tokens}
    plain = [token for token, alias in aliases.items() if alias is None]
    if plain and any(HOOKS[name].needs_eager for name in resolve_hooks(plain)):
        return []
    return [token for token, alias in aliases.items() if alias is not None and HOOKS[alias.hook].needs_eager]


def _check_prompt_text(prompts: Sequence[str]) -> None:
    """Refuse a prompt that is not text a tokenizer can take: stdin bytes that are not UTF-8
    arrive as lone surrogates (``surrogateescape``), on which tokenizers raise a bare
    ``TypeError``."""
    for number, prompt in enumerate(prompts, 1):
        bad = next((c for c in prompt if "\ud800" <= c <= "\udfff"), None)
        if bad is not None:
            byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if "\udc80" <= bad <= "\udcff" else f"U+{ord(bad):04X}"
            raise InvalidArgumentError(f"prompt {number} is not UTF-8 text ({byte} cannot be read); "
                                       "give prompts as UTF-8")


def _position_limit(model: Any) -> int | None:
    """How many positions the model can take at all: the size of a learned position table
    (GPT-2's ``n_positions``: a later position is an ``IndexError`` inside the model). Rotary
    models have none (``max_position_embeddings`` is the trained length, and scaled rotary
    models run past it), so they are not limited here."""
    return getattr(model.config, "n_positions", None)


def _encode(tokenizer: Any, prompts: Sequence[str], args: argparse.Namespace, limit: int | None) -> list[Any]:
    """Every batch of ``--batch-size`` prompts, tokenized (left-padded), before capture starts:
    a prompt that tokenizes to nothing, or that with ``--max-new-tokens`` needs more positions
    than the model has, is refused by its number here rather than failing mid-run with the
    batches before it already stored."""
    batches = []
    for start in range(0, len(prompts), args.batch_size):
        enc = tokenizer(list(prompts[start:start + args.batch_size]), return_tensors="pt", padding=True)
        for row, n in enumerate(enc["attention_mask"].sum(dim=1).tolist()):
            _check_length(start + row + 1, n, args.max_new_tokens, limit)
        batches.append(enc)
    return batches


def _check_length(number: int, tokens: int, max_new_tokens: int, limit: int | None) -> None:
    """Prompt ``number`` of ``tokens`` tokens must hold a token and, with the ``max_new_tokens - 1``
    decode inputs after it, fit ``limit`` positions."""
    if tokens == 0:
        raise InvalidArgumentError(f"prompt {number} is empty: the tokenizer gives it no token; "
                                   "remove it or give it some text")
    needed = tokens + max(max_new_tokens - 1, 0)
    if limit is not None and needed > limit:
        more = f" and --max-new-tokens {max_new_tokens} feeds {max_new_tokens - 1} more" if max_new_tokens > 1 else ""
        raise InvalidArgumentError(
            f"prompt {number} is {tokens} tokens{more}: {needed} positions, past the model's {limit} "
            f"(n_positions in its config); shorten the prompt{' or lower --max-new-tokens' if more else ''}")


def _quiet_transformers() -> None:
    """HF's own progress bars and advisory logs would interleave with ours; DMI reports progress."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()

