"""PNG plots of activation norms: a layers × tokens heatmap beside a per-layer curve.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend
state, no display needed). The image is exactly ``width × height`` pixels: the figure
size is set in inches at a fixed DPI and saved without tight cropping, so callers and
tests can rely on the size they asked for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dmi.storage.errors import InvalidArgumentError

__all__ = ["NormPlot", "token_norms", "write_norm_plot"]

_DPI = 100
BOUNDARY_COLOR = "#ff0000"  # the prefill/decode line: pure red, absent from the viridis heatmap


@dataclass(frozen=True, slots=True)
class NormPlot:
    """What a plot shows, as numbers (also what ``dmi plot --json`` prints)."""

    path: str
    width: int
    height: int
    layers: tuple[int, ...]
    n_tokens: int
    mean_norm_per_layer: tuple[float, ...]
    decode_start: int | None = None


def token_norms(stacked: torch.Tensor, token_axis: int = 1) -> torch.Tensor:
    """L2 norm of every token's values: ``[layers, ...]`` with tokens on ``token_axis`` →
    ``[layers, tokens]`` (float64). ``token_axis`` comes from the recorded layout (an
    attention pattern ``[layers, heads, q, kv]`` has its tokens on axis 2, not its heads)."""
    if stacked.dim() < 2 or not 1 <= token_axis < stacked.dim():
        raise InvalidArgumentError(
            f"need a [layers, ...] tensor with tokens on axis {token_axis} to plot, got shape {tuple(stacked.shape)}"
        )
    stacked = stacked.movedim(token_axis, 1)
    flat = stacked.reshape(stacked.shape[0], stacked.shape[1], -1).to(torch.float64)
    return torch.linalg.vector_norm(flat, dim=-1)


def write_norm_plot(
    norms: torch.Tensor,
    layers: Sequence[int],
    path: str | os.PathLike[str],
    *,
    title: str,
    width: int = 1200,
    height: int = 500,
    decode_start: int | None = None,
) -> NormPlot:
    """Write the heatmap (layers × tokens) and the per-layer mean-norm curve to a PNG.

    ``norms`` is ``[len(layers), tokens]``. ``decode_start``: the first decode position on
    the token axis; a dashed vertical line (``BOUNDARY_COLOR``) is drawn between it and the
    last prefill position. Returns what was drawn. Raises
    ``InvalidArgumentError`` for a size under 200×150 pixels or norms that do not match
    the layers.
    """
    if width < 200 or height < 150:
        raise InvalidArgumentError(f"plot size {width}x{height} is too small (at least 200x150 pixels)")
    if norms.dim() != 2 or norms.shape[0] != len(layers):
        raise InvalidArgumentError(f"norms of shape {tuple(norms.shape)} do not match {len(layers)} layers")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    values = norms.to(torch.float64).numpy()
    per_layer = values.mean(axis=1) if values.shape[1] else values.sum(axis=1)

    fig = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 2, width_ratios=(3, 1), wspace=0.3)
    heat = fig.add_subplot(grid[0])
    image = heat.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
    heat.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    heat.set_xlabel("token position")
    if decode_start is not None:
        _mark_decode_start(heat, decode_start, int(values.shape[1]))
    heat.set_ylabel("layer")
    heat.set_title(title, fontsize=10)
    fig.colorbar(image, ax=heat, label="L2 norm")

    curve = fig.add_subplot(grid[1])
    rows = range(len(layers))
    curve.plot(per_layer, list(rows), marker="o")
    curve.set_yticks(rows, [str(layer) for layer in layers])
    curve.set_ylim(-0.5, len(layers) - 0.5)
    curve.set_xlabel("mean L2 norm over tokens")
    curve.set_ylabel("layer")
    curve.grid(True, alpha=0.3)

    out = os.fspath(path)
    fig.savefig(out, format="png", dpi=_DPI)
    return NormPlot(
        path=out,
        width=width,
        height=height,
        layers=tuple(int(layer) for layer in layers),
        n_tokens=int(values.shape[1]),
        mean_norm_per_layer=tuple(float(v) for v in per_layer),
        decode_start=decode_start,
    )


def _mark_decode_start(heat, decode_start: int, n_tokens: int) -> None:
    """The prefill/decode boundary: a dashed line between the two phases' cells."""
    if not 0 < decode_start < n_tokens:
        raise InvalidArgumentError(f"decode_start {decode_start} is not inside the {n_tokens} plotted tokens")
    heat.axvline(decode_start - 0.5, color=BOUNDARY_COLOR, linestyle="--", linewidth=2)
    heat.set_xlabel("token position (dashed: decode starts)")
