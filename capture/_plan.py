"""The step plan: before a forward runs, which request rows and which real tokens each hook
will emit, and how many bytes each needs.

A batch is ``[batch, tokens]``; left padding is stripped. The plan holds one
:class:`RowSpan` per captured request (its row, its request id, its first real column, the
real position of that token, how many tokens) and one flat index of the real tokens over
``batch * tokens`` — ``None`` when every row is captured and nothing is padding, so the
copy into the ring is a plain contiguous copy. Records are cut from the gathered tensor by
``RowSpan.offset`` / ``RowSpan.n``; per-request work happens on the drain thread, never on
the model thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._hooks import HOOKS, ModelGeometry, _round16

__all__ = ["RowSpan", "StepPlan"]


@dataclass(frozen=True, slots=True)
class RowSpan:
    """One captured request within a step."""

    row: int  # batch row
    request_id: str
    first_col: int  # first real column of this step's input (left padding stripped)
    start: int  # real position (0 = first real prompt token) of that column
    n: int  # real tokens this step
    offset: int  # first row of this request in the gathered [n_rows, ...] tensor
    kv_pad: int  # left padding columns in the attention's key/value axis


@dataclass(slots=True)
class StepPlan:
    """What one admitted forward step captures."""

    batch: int
    tokens: int
    phase: str
    step: int
    spans: tuple[RowSpan, ...]
    index: torch.Tensor | None  # flat indices into batch*tokens, or None for "all of it"
    geometry: ModelGeometry
    hooks: dict[str, tuple[int, ...]]
    call_id: int = 0  # which generate/forward call the step belongs to
    kv_len: int = 0  # key columns of the padded sequence so far, this step's included (0: this step's own)
    _tails: dict[int, "StepPlan"] = field(default_factory=dict)
    _device_index: dict = field(default_factory=dict)
    n_rows: int = field(init=False)  # rows the step gathers: every span's tokens (read by every hook)

    def __post_init__(self) -> None:
        self.n_rows = sum(s.n for s in self.spans)

    @classmethod
    def build(
        cls,
        *,
        batch: int,
        tokens: int,
        phase: str,
        step: int,
        first_cols: list[int],
        starts: list[int],
        kv_pads: list[int],
        rows: list[int],
        request_ids: list[str],
        geometry: ModelGeometry,
        hooks: dict[str, tuple[int, ...]],
        call_id: int = 0,
        ends: list[int] | None = None,
        kv_len: int = 0,
    ) -> "StepPlan | None":
        """``ends``: each row's exclusive end column (default: the row's end); a row with no
        column left is not captured, and a step with none at all has no plan (``None``).
        ``kv_len``: the padded sequence's length after this step (see :meth:`key_pad`)."""
        spans = []
        offset = 0
        for r in rows:
            n = (tokens if ends is None else ends[r]) - first_cols[r]
            if n <= 0:
                continue
            spans.append(RowSpan(r, request_ids[r], first_cols[r], starts[r], n, offset, kv_pads[r]))
            offset += n
        if not spans:
            return None
        full = len(spans) == batch and all(s.first_col == 0 and s.n == tokens for s in spans)
        index = None if full else _flat_index(spans, tokens)
        return cls(batch, tokens, phase, step, tuple(spans), index, geometry, hooks, call_id, kv_len)

    def tail(self, t_out: int) -> "StepPlan":
        """The plan for a hook that materialises only the last ``t_out`` positions (logits)."""
        if t_out == self.tokens:
            return self
        plan = self._tails.get(t_out)
        if plan is None:
            lo = self.tokens - t_out
            spans, offset = [], 0
            for s in self.spans:
                col = max(s.first_col, lo)
                n = s.first_col + s.n - col  # a span may end before the row does (a position window)
                if n <= 0:
                    continue
                spans.append(RowSpan(s.row, s.request_id, col - lo, s.start + (col - s.first_col),
                                     n, offset, s.kv_pad))
                offset += n
            full = len(spans) == self.batch and all(s.first_col == 0 and s.n == t_out for s in spans)
            plan = StepPlan(self.batch, t_out, self.phase, self.step, tuple(spans),
                            None if full else _flat_index(spans, t_out), self.geometry, self.hooks, self.call_id,
                            self.kv_len)
            self._tails[t_out] = plan
        return plan

    def index_on(self, device: torch.device) -> torch.Tensor | None:
        """The flat index on ``device`` (copied once per step and device, asynchronously)."""
        if self.index is None or device.type == "cpu":
            return self.index
        idx = self._device_index.get(device)
        if idx is None:
            idx = self.index.pin_memory().to(device, non_blocking=True)
            self._device_index[device] = idx
        return idx

    def key_pad(self, span: RowSpan, kv_tokens: int) -> int:
        """The left-padding columns among ``kv_tokens`` key columns of ``span``'s row. A
        sliding-window cache keeps only the sequence's last keys: padding that slid out of the
        window is not among them, so fewer (or no) columns are padding — stripping all
        ``kv_pad`` would cut real keys."""
        slid = max(0, self.kv_len - kv_tokens)
        return max(0, span.kv_pad - slid)

    def hook_bytes(self, hook: str, kv_tokens: int | None = None) -> int:
        """Bytes this step reserves for one (hook, layer), rounded up to 16.

        A hook with a key axis (``attn_pattern``) reserves one region per request
        (``kv_tokens`` = the key length).
        """
        spec = HOOKS[hook]
        g = self.geometry
        if spec.key_axis is not None:
            kv = self.tokens if kv_tokens is None else kv_tokens
            return sum(spec.record_bytes(g, s.n, kv - self.key_pad(s, kv)) for s in self.spans)
        per_token = 1
        for d in spec.feature_shape(g):
            per_token *= d
        return _round16(self.n_rows * per_token * spec.dtype(g).itemsize)

    def total_bytes(self) -> int:
        """Bytes the whole step reserves (logits at every position; patterns at kv = tokens)."""
        return sum(self.hook_bytes(h) * len(layers) for h, layers in self.hooks.items())


def _flat_index(spans, tokens: int) -> torch.Tensor:
    if not spans:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(s.row * tokens + s.first_col, s.row * tokens + s.first_col + s.n) for s in spans])
