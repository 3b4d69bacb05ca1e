"""Token strings and prompt text, kept with a request when capture knows the tokenizer.

They are records of their own, beside the numbers, so they travel the same path: sealed
packs (which carry their own index), the catalog protocol, ``recover``, ``delete``. No
new storage path and no record field:

* ``token_text``: one record per ``token_ids`` record, with its exact key (same request,
  start token, token count, step, phase) but this hook name. Its payload holds
  ``tokenizer.convert_ids_to_tokens`` of those ids.
* ``prompt_text``: one record per request, beside the ``token_ids`` record of its prefill
  (or scoring forward): ``tokenizer.decode(prompt ids, skip_special_tokens=True)``.

Payload: ``storage/_strings.py`` (its format; ``dmi.storage.encode_strings`` and
``decode_strings``, without torch, so ``dmi show`` reads them back without loading it).

The work happens on the drain thread, never on the model's: ``attach`` turns the whole
vocabulary into one UTF-8 table with a single batched ``convert_ids_to_tokens`` (so a
tokenizer that cannot do it is refused before the model is touched), and each
``token_ids`` record then becomes its strings by a few NumPy gathers over that table,
without a Python loop over tokens and without calling the tokenizer again. Only the prompt text calls the
tokenizer (``decode``, once per request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dmi import storage
from dmi.storage import NO_STRING, decode_strings
from dmi.storage.errors import InvalidArgumentError
from dmi.storage.records import PROMPT_TEXT, TEXT_HOOKS, TOKEN_TEXT

from ._hooks import HOOKS
from ._selection import Selection

__all__ = ["TOKEN_TEXT", "PROMPT_TEXT", "TEXT_HOOKS", "TokenStrings", "encode_strings", "decode_strings",
           "with_token_ids"]


class TokenStrings:
    """A tokenizer's string for each of its ids, as one UTF-8 table. An id past the
    tokenizer (a model vocabulary padded beyond it) has no string: ``None``, as
    ``convert_ids_to_tokens`` says for it. Raises ``InvalidArgumentError`` for an object
    that is not a tokenizer (no ``convert_ids_to_tokens`` / ``decode``, or strings that are
    not ``str``).
    """

    def __init__(self, tokenizer: Any):
        for method in ("convert_ids_to_tokens", "decode"):
            if not callable(getattr(tokenizer, method, None)):
                raise InvalidArgumentError(
                    f"tokenizer= needs a Hugging Face tokenizer (with {method}); got {type(tokenizer).__name__}"
                )
        try:
            strings = list(tokenizer.convert_ids_to_tokens(list(range(_id_count(tokenizer)))))
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is the caller's argument
            raise InvalidArgumentError(f"tokenizer= cannot list its vocabulary: {exc!r}") from exc
        bad = next((s for s in strings if s is not None and not isinstance(s, str)), None)
        if bad is not None:
            raise InvalidArgumentError(f"tokenizer= gave a token that is not a string: {bad!r}")
        self.tokenizer = tokenizer
        encoded = [b"" if s is None else s.encode("utf-8") for s in strings]
        self._lengths = np.array([NO_STRING if s is None else len(b) for s, b in zip(strings, encoded)], dtype=np.int64)
        sizes = np.maximum(self._lengths, 0)
        self._starts = np.cumsum(sizes) - sizes
        self._blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._lengths)

    def token_record(self, ids: torch.Tensor) -> torch.Tensor:
        """The ``token_text`` payload of one ``token_ids`` record (int64 ``[n]``, on the CPU).
        NumPy on the host: a handful of array operations, whatever ``n``."""
        ids = ids.reshape(-1).numpy().astype(np.int64, copy=False)
        inside = (ids >= 0) & (ids < len(self))
        safe = np.where(inside, ids, 0)
        lengths = np.where(inside, self._lengths[safe], NO_STRING)
        sizes = np.maximum(lengths, 0)
        ends = np.cumsum(sizes)
        # byte j of token i sits at starts[id] + j: repeat each token's (start - its output offset)
        shift = np.repeat(self._starts[safe] - (ends - sizes), sizes)
        return torch.from_numpy(storage.pack_strings(lengths, self._blob[shift + np.arange(len(shift))].tobytes()))

    def prompt_record(self, ids: torch.Tensor) -> torch.Tensor:
        """The ``prompt_text`` payload: the prompt's ids decoded, special tokens skipped."""
        text = self.tokenizer.decode(ids.reshape(-1).tolist(), skip_special_tokens=True)
        return encode_strings([text])


def _id_count(tokenizer: Any) -> int:
    """How many ids the table covers: one past the tokenizer's largest id. ``len(tokenizer)``
    counts its tokens, which is that only where the ids run without gaps; a vocabulary with a
    gap (ids ``0..3`` and ``10``) holds ids at and past ``len``, which would otherwise have no
    string though ``convert_ids_to_tokens`` has one for them (ids in a gap: ``None``)."""
    count = len(tokenizer)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    ids = get_vocab().values() if callable(get_vocab) else ()
    return max(count, 1 + max(ids, default=-1))


def encode_strings(strings: Sequence[str | None]) -> torch.Tensor:
    """``strings`` as one ``uint8`` payload (the format in the module docstring)."""
    return torch.from_numpy(storage.encode_strings(strings))


def with_token_ids(selection: Selection) -> Selection:
    """``selection`` with ``token_ids`` added (the strings are cut from its records)."""
    if "token_ids" in selection.hooks:
        return selection
    hooks = {name: selection.hooks.get(name, (-1,)) for name in HOOKS
             if name in selection.hooks or name == "token_ids"}
    return Selection(hooks, selection.layers)
