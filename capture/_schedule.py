"""Schedule: which forward steps and which requests are captured.

Steps are numbered per call: ``0`` is the prefill (or the single step of a scoring
``forward``), ``1, 2, ...`` are decode steps. A step the schedule refuses dispatches nothing:
no copy, no ring reservation, no record.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dmi.storage.errors import InvalidArgumentError
from dmi.storage.records import PHASES

__all__ = ["Schedule"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """When to capture.

    * ``phases``: any of ``"prefill"``, ``"decode"``, ``"forward"`` (scoring passes), each once.
    * ``step_stride``: capture decode step ``d`` (1-based) when ``(d - 1) % step_stride == 0``
      — the first decode step is always captured; prefill is not affected.
    * ``request_stride``: capture the ``n``-th request of the session (0-based, counted over
      every call) when ``n % request_stride == 0``.
    * ``warmup``: ignore the first ``warmup`` model forwards after attaching.
    * ``last_tokens``: keep only the last ``N`` real tokens of each request's prompt (its
      prefill or scoring forward; padding never counts); decode tokens, each the newest token
      of its request, are kept as the other fields say. ``None`` (default): every token.
      Records start at the first kept position (``start_token``), so a request's tokens stay
      contiguous; with ``phases=("prefill", "forward")`` only the prompt's last ``N`` remain.
    * ``positions``: ``(start, stop)`` — keep only tokens at real positions ``start <= p < stop``
      of each request (0 = its first real prompt token; ``stop`` ``None``: no upper bound),
      prompt and decode tokens alike; a step with no token in the window dispatches nothing.
      With ``last_tokens`` both apply.
    """

    phases: tuple[str, ...] = PHASES
    step_stride: int = 1
    request_stride: int = 1
    warmup: int = 0
    last_tokens: int | None = None
    positions: tuple[int, int | None] | None = None

    def __post_init__(self):
        object.__setattr__(self, "phases", _phases(self.phases))
        for name in ("step_stride", "request_stride"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"schedule {name} must be an int >= 1, got {v!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise InvalidArgumentError(f"schedule warmup must be an int >= 0, got {self.warmup!r}")
        n = self.last_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise InvalidArgumentError(f"schedule last_tokens must be None or an int >= 1, got {n!r}")
        if self.positions is not None:
            object.__setattr__(self, "positions", _window(self.positions))

    @classmethod
    def coerce(cls, value) -> "Schedule":
        if value is None:
            return cls()
        if isinstance(value, Schedule):
            return value
        if isinstance(value, dict):
            names = [f.name for f in fields(cls)]
            unknown = sorted(map(repr, set(value) - set(names)))
            if unknown:
                raise InvalidArgumentError(f"schedule has no field(s) {', '.join(unknown)}; its fields: {', '.join(names)}")
            return cls(**value)
        if isinstance(value, (str, tuple, list)):
            return cls(phases=value)
        raise InvalidArgumentError(f"schedule must be a Schedule, a dict or phases, got {value!r}")

    def admits_step(self, forward_index: int, phase: str, step: int) -> bool:
        """``forward_index``: model forwards since attach (for warmup); ``step``: within the call."""
        if forward_index < self.warmup or phase not in self.phases:
            return False
        return phase != "decode" or (step - 1) % self.step_stride == 0

    def admits_request(self, sequence: int) -> bool:
        return sequence % self.request_stride == 0

    def trim_prompt(self, phase: str, first_cols: list[int], starts: list[int],
                    tokens: int) -> tuple[list[int], list[int]]:
        """``(first_cols, starts)`` of a step's rows after ``last_tokens``: a prompt step's rows
        skip their leading real tokens (column and real position move together); a decode step,
        or no ``last_tokens``, is unchanged."""
        if self.last_tokens is None or phase == "decode":
            return first_cols, starts
        skips = [max(0, tokens - col - self.last_tokens) for col in first_cols]
        return [c + k for c, k in zip(first_cols, skips)], [s + k for s, k in zip(starts, skips)]

    def window(self, first_cols: list[int], starts: list[int], tokens: int) -> tuple[list[int], list[int], list[int]]:
        """``(first_cols, starts, ends)`` of a step's rows inside ``positions``: each row keeps the
        columns whose real positions fall in the window (``ends``: exclusive end columns; a row
        with nothing in it gets ``end == first_col``). Without ``positions``, rows run to the end."""
        if self.positions is None:
            return first_cols, starts, [tokens] * len(first_cols)
        lo, hi = self.positions
        cols, firsts, ends = [], [], []
        for col, start in zip(first_cols, starts):
            skip = max(0, lo - start)
            first = min(tokens, col + skip)
            end = tokens if hi is None else max(first, min(tokens, col + (hi - start)))
            cols.append(first)
            firsts.append(start + (first - col))
            ends.append(end)
        return cols, firsts, ends


def _phases(value) -> tuple:
    """``phases`` as a tuple of distinct phase names: one name, or an iterable of them. A phase
    listed twice is refused, as the CLI and plan files refuse it: most likely a typo for another
    phase, which a silent dedupe would hide."""
    if isinstance(value, str):
        value = (value,)
    try:
        phases = tuple(value)
    except TypeError as exc:
        raise InvalidArgumentError(
            f"schedule phases must be a phase name or several of {PHASES}, got {value!r}") from exc
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise InvalidArgumentError(f"schedule phases {bad or phases!r} invalid; choose from {PHASES}")
    repeated = sorted({p for p in phases if phases.count(p) > 1})
    if repeated:
        raise InvalidArgumentError(
            f"schedule phases {phases!r} lists {', '.join(map(repr, repeated))} more than once; name each phase once")
    return phases


def _window(value) -> tuple[int, int | None]:
    """``positions`` as ``(start, stop)``: ints, ``0 <= start < stop`` (``stop`` may be None)."""
    try:
        start, stop = value
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"schedule positions must be (start, stop), got {value!r}") from None
    ok_start = isinstance(start, int) and not isinstance(start, bool) and start >= 0
    ok_stop = stop is None or (isinstance(stop, int) and not isinstance(stop, bool) and stop > (start if ok_start else 0))
    if not (ok_start and ok_stop):
        raise InvalidArgumentError(
            f"schedule positions must be (start, stop) with 0 <= start < stop (stop None: no end), got {value!r}")
    return start, stop
