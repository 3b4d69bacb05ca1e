"""Output for people: human-sized numbers, plain-text tables and a progress bar.

The CLI prints through these helpers so that every command sizes numbers the same way
and every long-running command reports progress the same way (on stderr, only when
stderr is a terminal and ``--quiet`` is off, so pipes and ``--json`` stay clean): a bar
when the total is known (``Progress``), a status line when it is not (``Status``: loading
a model).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO

__all__ = ["human_bytes", "human_count", "human_seconds", "plural", "render_table", "Progress", "Status"]

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``1536`` → ``'1.5 KiB'``: binary units, three significant digits, exact below 1 KiB."""
    value = float(n)
    for unit in _BYTE_UNITS:
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    """``12345`` → ``'12.3k'``: decimal suffixes for counts, exact below a thousand."""
    value = float(n)
    if abs(value) < 1000:
        return str(int(value)) if value == int(value) else f"{value:.3g}"
    for suffix in ("k", "M", "G", "T"):
        value /= 1000
        if abs(value) < 1000 or suffix == "T":
            return f"{value:.3g}{suffix}"
    raise AssertionError("unreachable")


def plural(n: int, noun: str, number: Callable[[int], str] = str) -> str:
    """``plural(1, "pack")`` → ``'1 pack'``; ``plural(3, "pack")`` → ``'3 packs'``; ``number``
    formats the count (``human_count`` for ``'12.3k records'``)."""
    return f"{number(n)} {noun}{'' if n == 1 else 's'}"


def human_seconds(seconds: float) -> str:
    """``0.0123`` → ``'12.3 ms'``; ``75`` → ``'1m15s'``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A left-aligned plain-text table; numbers are right-aligned. Empty → just the header."""
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(row[i]) for row in cells[1:]) and len(cells) > 1 for i in range(len(headers))
    ]
    lines = []
    for n, row in enumerate(cells):
        parts = [
            cell.rjust(widths[i]) if numeric[i] and n else cell.ljust(widths[i]) for i, cell in enumerate(row)
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    try:
        float(text.split(" ")[0].rstrip("kMGT×x%"))
    except ValueError:
        return False
    return True


class Progress:
    """A one-line progress bar on a terminal; silent otherwise.

    ``enabled=None`` means "if the stream is a terminal". Use as a context manager; the
    line is cleared on exit so later output starts on a clean line.
    """

    def __init__(self, label: str, total: int, *, enabled: bool | None = None, stream: TextIO | None = None):
        self.label = label
        self.total = max(int(total), 0)
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = self._stream.isatty() if enabled is None else enabled
        self._last_draw = 0.0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self._stream.write("\r\033[K")
            self._stream.flush()

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units; redraws at most ten times a second."""
        self.done += n
        self._draw(force=self.done >= self.total)

    def _draw(self, *, force: bool) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 30
        frac = self.done / self.total if self.total else 1.0
        filled = int(width * min(frac, 1.0))
        bar = "#" * filled + "." * (width - filled)
        self._stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
        self._stream.flush()


class Status:
    """One status line on a terminal while a step with no countable progress runs (importing
    torch and loading a model): drawn on entry, cleared on exit; silent otherwise.

    ``enabled=None`` means "if the stream is a terminal".
    """

    def __init__(self, text: str, *, enabled: bool | None = None, stream: TextIO | None = None):
        self.text = text
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = self._stream.isatty() if enabled is None else enabled

    def __enter__(self) -> Status:
        if self._enabled:
            self._stream.write(f"\r{self.text} ...")
            self._stream.flush()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self._stream.write("\r\033[K")
            self._stream.flush()
