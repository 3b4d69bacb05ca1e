"""Batches for the generate / forward entry points: left padding, masks, request ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dmi.storage.errors import InvalidArgumentError

__all__ = ["CaptureResult", "prepare_batch", "left_pads"]


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
    """``(input_ids [b, t], attention_mask [b, t])``; lists of token ids are left-padded."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            mask = attention_mask if attention_mask.dim() == 2 else attention_mask.unsqueeze(0)
            if mask.shape != ids.shape:
                raise InvalidArgumentError(
                    f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(ids.shape)}"
                )
        return ids, mask
    if attention_mask is not None:
        raise InvalidArgumentError("attention_mask is built for you when prompts are lists of token ids")
    prompts = [list(p) for p in input_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidArgumentError("every prompt needs at least one token")
    if pad_token_id is None:
        pad_token_id = 0
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p):] = 1
    return ids, mask


def left_pads(mask: torch.Tensor) -> list[int]:
    """Leading zero count of each row; refuses masks that are not left-padded."""
    m = mask.detach().to("cpu", torch.long)
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
