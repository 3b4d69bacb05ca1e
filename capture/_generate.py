"""Batches for the generate / forward entry points: left padding, masks, request ids, and
how many sequences ``generate`` runs per prompt."""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass
from typing import Any

import torch

from dmi.storage.errors import InvalidArgumentError, UnsupportedGenerationError

__all__ = ["CaptureResult", "SequenceEnds", "cached_tokens", "eos_token_ids", "prepare_batch", "left_pads",
           "refuse_past_vocabulary", "sequences_per_prompt"]


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """What ``session.generate`` / ``session.forward`` return.

    ``request_ids[i]`` names batch row ``i``; ``output`` is exactly what the model returned
    (``model.generate``'s tensor or ``GenerateOutput``; the forward's ``ModelOutput``).
    Behaves as the pair ``(request_ids, output)``: unpacks as ``request_ids, output =
    session.generate(...)``, indexes as ``result[0]`` / ``result[1]`` (``result[-1]`` and
    slices too), has ``len`` 2.
    """

    request_ids: tuple[str, ...]
    output: Any

    def _pair(self) -> tuple[tuple[str, ...], Any]:
        return self.request_ids, self.output

    def __iter__(self):
        return iter(self._pair())

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index):
        return self._pair()[index]

    @property
    def sequences(self) -> torch.Tensor:
        out = self.output
        return out if isinstance(out, torch.Tensor) else out.sequences


def prepare_batch(input_ids, attention_mask=None, *, pad_token_id: int | None = None):
    """``(input_ids [b, t], attention_mask [b, t])``; lists of token ids are left-padded.
    Anything else (a negative token id included) is refused here with
    :class:`InvalidArgumentError`, before the model runs."""
    if isinstance(input_ids, torch.Tensor):
        return _tensor_batch(input_ids, attention_mask)
    if attention_mask is not None:
        raise InvalidArgumentError("attention_mask is built for you when prompts are lists of token ids")
    prompts = _prompts(input_ids)
    if pad_token_id is None:
        pad_token_id = 0
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p):] = 1
    return ids, mask


def _tensor_batch(input_ids: torch.Tensor, attention_mask):
    """A ``[b, t]`` (or one prompt's ``[t]``) tensor of token ids, at least one of each, and
    its mask: a tensor of the same shape, or ``None`` (every token real)."""
    if input_ids.dim() not in (1, 2):
        raise InvalidArgumentError("input_ids must be a [batch, tokens] tensor (or one prompt's [tokens]), "
                                   f"got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise InvalidArgumentError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
    if ids.numel() == 0:
        raise InvalidArgumentError(f"input_ids needs at least one row and one token, got shape {tuple(ids.shape)}")
    _refuse_negative(ids.detach().min().item())
    if attention_mask is None:
        return ids, torch.ones_like(ids)
    if not isinstance(attention_mask, torch.Tensor):
        raise InvalidArgumentError(
            f"attention_mask must be a tensor of input_ids' shape (or None: every token real), "
            f"got {type(attention_mask).__name__}")
    mask = attention_mask if attention_mask.dim() == 2 else attention_mask.unsqueeze(0)
    if mask.shape != ids.shape:
        raise InvalidArgumentError(
            f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(ids.shape)}"
        )
    return ids, _binary_mask(mask)


def _binary_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as int64 0/1, of any real dtype (a float ``torch.ones`` included) whose values
    are all exactly 0 or 1; any other value is refused. Transformers reads a mask two ways at
    once — attention as ``mask.bool()`` (0.5 or 2: a real token), generate's position ids from
    ``mask.long().cumsum()`` (0.5: padding, 2: two positions) — so no one reading of such a
    value is what the model did, and DMI's padding count would silently disagree with one."""
    if mask.dtype.is_complex:
        raise InvalidArgumentError(f"attention_mask must hold 0 (padding) and 1 (real token), got dtype {mask.dtype}")
    values = mask.detach()
    other = values[(values != 0) & (values != 1)]
    if other.numel():
        shown = ", ".join(map(str, other.unique()[:5].tolist()))
        raise InvalidArgumentError(
            f"attention_mask must hold only 0 (padding) and 1 (real token), got {other.numel()} other value(s): "
            f"{shown}; pass the tokenizer's mask, or (mask != 0).long() if every non-zero marks a real token"
        )
    return values.to(torch.long)


def _prompts(input_ids) -> list[list[int]]:
    """``input_ids`` given as prompts: a non-empty list of them, each a non-empty sequence of
    token ids (ints; a string is text, not token ids)."""
    try:
        prompts = [[_token_id(token) for token in p] for p in input_ids]
    except TypeError as exc:
        raise InvalidArgumentError(
            "input_ids must be a [batch, tokens] tensor or a list of prompts, each a list of token ids "
            f"(ints), got {_describe(input_ids)}") from exc
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidArgumentError("every prompt needs at least one token")
    _refuse_negative(min(min(p) for p in prompts))
    return prompts


def _token_id(token) -> int:
    """One token id of a prompt given as a list: an int (a NumPy or 0-d tensor integer too),
    never a bool — ``True`` would silently be token 1, where a bool tensor is refused."""
    if isinstance(token, bool) or (isinstance(token, torch.Tensor) and token.dtype == torch.bool):
        raise TypeError("a bool is not a token id")
    return operator.index(token)


def _refuse_negative(lowest: int) -> None:
    """Refuse a batch whose smallest token id is negative, before the model runs: its embedding
    would fail with a bare ``IndexError`` after capture had already stored the prefill's
    ``token_ids`` record of a request that never ran."""
    if lowest < 0:
        raise InvalidArgumentError(
            f"input_ids hold a negative token id ({lowest}); token ids (padding included) must be >= 0: "
            "pad with the tokenizer's pad_token_id and mark padding in attention_mask")


def refuse_past_vocabulary(ids: torch.Tensor, model) -> None:
    """Refuse token ids at or past the model's vocabulary (``config.vocab_size``, the text
    model's in a composite config), before the model runs: the embedding would fail with a bare
    ``IndexError`` after capture had already stored the prefill's ``token_ids`` record of a
    request that never ran. A config without ``vocab_size`` is not checked."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or ids.numel() == 0:
        return
    highest = int(ids.max())
    if highest >= vocab:
        raise InvalidArgumentError(
            f"input_ids hold token id {highest}, past the model's vocabulary of {vocab} (ids 0-{vocab - 1}): "
            "encode the prompts with this model's tokenizer")


def _describe(value) -> str:
    """A short account of ``value`` for an error message (a long list is not repeated whole)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{type(value).__name__} {text[:77]}..."


def left_pads(mask: torch.Tensor) -> list[int]:
    """Leading zero count of each row; refuses masks that are not left-padded or hold a value
    other than 0 and 1 (also a mask handed to the model directly, not through ``prepare_batch``)."""
    m = _binary_mask(mask.detach().to("cpu"))
    pads = (m.cumsum(1) == 0).sum(1)
    real = m.sum(1)
    t = m.shape[1]
    bad = ((pads + real) != t).nonzero().flatten().tolist()
    if bad:
        raise InvalidArgumentError(
            f"attention_mask rows {bad} are not left-padded (zeros must all come first); "
            "DMI captures left-padded batches (tokenizer.padding_side = 'left')"
        )
    if (real == 0).any():
        raise InvalidArgumentError("an attention_mask row has no real token")
    return pads.tolist()


def sequences_per_prompt(model_config, generate_kwargs: dict) -> int:
    """How many batch rows ``model.generate`` runs (and returns) per prompt row.

    Sampling with ``num_return_sequences=n`` repeats every prompt row ``n`` times before
    the first forward (row ``i * n + j`` is sequence ``j`` of prompt ``i``) and never mixes
    rows afterwards, so each returned sequence is captured as its own request. Beam search
    (``num_beams > 1``) reorders and forks its rows at every step — a batch row is not one
    sequence — so it is refused here, before the model runs, with
    :class:`UnsupportedGenerationError`; so are assisted generation, a cache that already
    holds tokens, and ``use_cache=False`` (:func:`_refuse_unfollowable_steps`).
    ``model_config`` is the model's ``generation_config``; ``generate_kwargs`` override it as
    they do in ``generate``.
    """
    config = generate_kwargs.get("generation_config") or model_config
    beams = _setting(config, generate_kwargs, "num_beams")
    if beams > 1:
        raise UnsupportedGenerationError(
            f"beam search (num_beams={beams}) cannot be captured: beams are reordered and forked at "
            "every step, so no batch row is one sequence. Capture sampling or greedy generation "
            "(num_beams=1), or capture the returned sequences with session.forward(...)"
        )
    _refuse_unfollowable_steps(config, generate_kwargs)
    return _setting(config, generate_kwargs, "num_return_sequences")


_CANDIDATE_SETTINGS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
"""Generation settings that verify guessed tokens with the model (assisted / speculative
decoding): a keyword, or (all but ``assistant_model``) a generation-config field."""


def _refuse_unfollowable_steps(config, generate_kwargs: dict) -> None:
    """Refuse, with :class:`UnsupportedGenerationError`, generation whose forwards are not one
    prompt then one new token per step, which capture's positions assume:

    * assisted / speculative decoding feeds guessed tokens and drops the rejected ones from
      the cache, so guesses would be stored as tokens of the sequence and every later
      position shifted;
    * a cache that already holds tokens (``cache=`` / ``past_key_values=``, continuing an
      earlier generation) makes the first forward feed only the tokens after them, which
      would be stored as the request's first positions;
    * ``use_cache=False`` feeds the whole sequence, padding included, at every decode step,
      so each step would be stored as that many new tokens at the wrong positions."""
    given = [name for name in _CANDIDATE_SETTINGS
             if generate_kwargs.get(name, getattr(config, name, None)) is not None]
    if given:
        raise UnsupportedGenerationError(
            f"assisted generation ({', '.join(given)}) cannot be captured: the model verifies guessed "
            "tokens and drops the rejected ones, so guesses would be stored as tokens of the sequence. "
            "Generate without it, or capture the returned sequences with session.forward(...)"
        )
    cached = cached_tokens(generate_kwargs)
    if cached:
        raise UnsupportedGenerationError(
            f"generate from a cache that already holds {cached} token(s) cannot be captured: the model is fed "
            "only the tokens after them, which would be stored as the request's first positions. Pass a "
            "fresh cache (or none), or capture the whole sequence with session.forward(...)"
        )
    if generate_kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        raise UnsupportedGenerationError(
            "generate with use_cache=False cannot be captured: every decode step re-feeds the whole "
            "sequence, so its tokens would be stored as new ones at the wrong positions. Generate with "
            "the cache (use_cache=True, the default), or capture the returned sequences with "
            "session.forward(...)"
        )


def cached_tokens(generate_kwargs: dict) -> int:
    """Tokens a cache given to ``generate`` (``cache=`` or ``past_key_values=``) already holds."""
    cache = generate_kwargs.get("cache", generate_kwargs.get("past_key_values"))
    if cache is None or not hasattr(cache, "get_seq_length"):
        return 0
    return int(cache.get_seq_length())


def eos_token_ids(model_config, generate_kwargs: dict) -> frozenset[int]:
    """The token ids that end a sequence in this ``generate`` call: ``eos_token_id`` given as a
    keyword, else the generation config's (``generation_config=`` or the model's); an int, a
    list or a tensor of them. Empty where none is set (the sequences run to the call's end)."""
    config = generate_kwargs.get("generation_config") or model_config
    value = generate_kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    if value is None:
        return frozenset()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    return frozenset(int(v) for v in (value if isinstance(value, (list, tuple, set, frozenset)) else [value]))


class SequenceEnds:
    """Which rows of one ``generate`` call have ended, as ``generate`` itself decides.

    transformers marks a row finished whenever its stopping criteria say so — the end-of-sequence
    token, ``stop_strings``, ``max_length``, a criterion of the caller's — then runs it on, fed
    padding, until every row is done. :meth:`watching` shows DMI each step's verdict (the
    criteria's per-row ``is_done``), accumulated on the device; :meth:`ended_rows` reads it
    once per decode step. Where this transformers has no ``_get_stopping_criteria`` to watch
    (or the call never asked it for criteria), a row ends where it is fed one of ``eos_ids``."""

    def __init__(self, eos_ids: frozenset[int]):
        self._eos = torch.tensor(sorted(eos_ids), dtype=torch.long) if eos_ids else None
        self._done: torch.Tensor | None = None  # rows the criteria marked done so far (bool [b])

    def ended_rows(self, ids: torch.Tensor | None) -> list[int]:
        """The rows ended by the tokens this decode step feeds (and those ended before): one
        host read, of the criteria's verdict, else of which rows ``ids`` feeds an end token."""
        if self._done is not None:
            return self._done.nonzero().flatten().tolist()
        if self._eos is None or ids is None:
            return []
        fed = ids[:, -1]
        if self._eos.device != fed.device:  # moved once per call, not at every step
            self._eos = self._eos.to(fed.device)
        return torch.isin(fed, self._eos).nonzero().flatten().tolist()

    @contextlib.contextmanager
    def watching(self, model):
        """For the call's duration, the criteria ``model._get_stopping_criteria`` returns report
        each verdict here (the criteria themselves, the caller's included, run as they would);
        without that hook, nothing changes (the end-of-sequence rule holds)."""
        own = vars(model).get("_get_stopping_criteria", _NOT_SET)
        original = getattr(model, "_get_stopping_criteria", None)
        if not callable(original):
            yield
            return

        @functools.wraps(original)
        def watched(*args, **kwargs):
            return self._watched(original(*args, **kwargs))

        model._get_stopping_criteria = watched
        try:
            yield
        finally:
            if own is _NOT_SET:
                del model._get_stopping_criteria
            else:
                model._get_stopping_criteria = own

    def _watched(self, criteria):
        """``criteria`` (a ``StoppingCriteriaList``) as one of its own type whose verdicts reach
        :meth:`_saw` (subclassed here, so that capture imports no transformers)."""
        saw = self._saw

        class Watched(type(criteria)):
            def __call__(self, input_ids, scores, **kwargs):
                is_done = super().__call__(input_ids, scores, **kwargs)
                saw(is_done)
                return is_done

        return Watched(criteria)

    def _saw(self, is_done: torch.Tensor) -> None:
        """One step's verdict, or-ed into the rows done so far on the device (no host read)."""
        self._done = is_done if self._done is None else self._done | is_done


_NOT_SET = object()


def _setting(config, generate_kwargs: dict, name: str) -> int:
    """A positive int generation setting: the keyword, else the config's, else 1."""
    value = generate_kwargs.get(name)
    if value is None:
        value = getattr(config, name, None)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    return value
