"""PNG plots of activation norms: a layers × tokens heatmap beside a per-layer curve.

The token axis can carry the request's token strings (``token_labels``) and a dashed line
at the prefill/decode boundary (``decode_start``); ``norm_figure`` returns the figure
itself, so what the axis shows can be checked on the object, not on pixels.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend
state, no display needed). The image is exactly ``width × height`` pixels: the figure
size is set in inches at a fixed DPI and saved without tight cropping, so callers and
tests can rely on the size they asked for.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dmi._export import write_file
from dmi.storage.errors import InvalidArgumentError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["NormPlot", "token_norms", "check_plottable", "check_png_name", "write_norm_plot", "norm_figure", "axis_token_labels", "MAX_LABEL_CHARS"]

_DPI = 100
_HEAT_SHARE = 0.4  # the heatmap's share of the figure's width
_LABEL_PIXELS = 12  # horizontal room one vertical token label needs
MAX_LABEL_CHARS = 12
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
    token_labels: tuple[str, ...] = ()  # what the token axis shows, "position:label"


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


def check_plottable(hook: str, dtype: torch.dtype) -> None:
    """Refuse, with ``InvalidArgumentError``, a hook of ids (``token_ids``, ``router_topk``):
    an id has no norm to draw. Called before its payload is read."""
    if not dtype.is_floating_point:
        raise InvalidArgumentError(
            f"{hook} holds {str(dtype).removeprefix('torch.')} ids, not activations: there is no norm to plot; "
            "plot an activation hook such as resid_post (dmi show lists what the request holds)")


def check_png_name(path: str) -> None:
    """Refuse, with ``InvalidArgumentError``, a file name that does not end in ``.png``: the
    plot is a PNG whatever the name says (``x.svg`` would hold PNG bytes)."""
    if os.path.splitext(path)[1].lower() != ".png":
        raise InvalidArgumentError(f"the plot is a PNG image: name it FILE.png, not {path!r}")


def write_norm_plot(
    norms: torch.Tensor,
    layers: Sequence[int],
    path: str | os.PathLike[str],
    *,
    title: str,
    width: int = 1200,
    height: int = 500,
    decode_start: int | None = None,
    token_labels: Sequence[str] | None = None,
) -> NormPlot:
    """Write the heatmap (layers × tokens) and the per-layer mean-norm curve to a PNG.

    ``norms`` is ``[len(layers), tokens]``. ``decode_start``: the first decode position on
    the token axis; a dashed vertical line (``BOUNDARY_COLOR``) is drawn between it and the
    last prefill position. ``token_labels``: one string per token (the token strings), shown
    on the token axis (see :func:`norm_figure`). Returns what was drawn. Raises
    ``InvalidArgumentError`` for a file ``path`` not named ``.png`` or a directory, a size under
    200×150 pixels, norms that do not match the layers, labels that do not match the tokens, or
    a file that cannot be created there; ``ExportError`` when the write fails part-way (a full
    disk). The PNG is written beside ``path`` and renamed into place when complete, so a failed
    or interrupted write leaves no partial file, and an existing plot there as it was.
    """
    out = os.fspath(path)
    if not os.path.isdir(out):  # a directory is "cannot write ...: Is a directory", from write_file
        check_png_name(out)
    fig = norm_figure(norms, layers, title=title, width=width, height=height, decode_start=decode_start,
                      token_labels=token_labels)
    with warnings.catch_warnings():  # a token the font cannot draw (e.g. CJK in DejaVu Sans) shows as a box
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font", category=UserWarning)
        write_file(out, lambda handle: fig.savefig(handle, format="png", dpi=_DPI))
    heat, curve = fig.axes[0], fig.axes[-1]
    return NormPlot(
        path=out,
        width=width,
        height=height,
        layers=tuple(int(layer) for layer in layers),
        n_tokens=int(norms.shape[1]),
        mean_norm_per_layer=tuple(float(v) for v in curve.lines[0].get_xdata()),
        decode_start=decode_start,
        token_labels=axis_token_labels(heat) if token_labels is not None else (),
    )


def norm_figure(
    norms: torch.Tensor,
    layers: Sequence[int],
    *,
    title: str,
    width: int = 1200,
    height: int = 500,
    decode_start: int | None = None,
    token_labels: Sequence[str] | None = None,
) -> Figure:
    """The figure :func:`write_norm_plot` saves: ``fig.axes[0]`` is the heatmap, the last
    axes the per-layer curve. With ``token_labels``, the heatmap's token axis is labelled by
    them (every token while they fit, about one per 12 pixels; otherwise every ``k``-th,
    and always the first decode token), each cut to ``MAX_LABEL_CHARS``."""
    if width < 200 or height < 150:
        raise InvalidArgumentError(f"plot size {width}x{height} is too small (at least 200x150 pixels)")
    if norms.dim() != 2 or norms.shape[0] != len(layers):
        raise InvalidArgumentError(f"norms of shape {tuple(norms.shape)} do not match {len(layers)} layers")
    if token_labels is not None and len(token_labels) != norms.shape[1]:
        raise InvalidArgumentError(f"{len(token_labels)} token labels for {norms.shape[1]} plotted tokens")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    values = norms.to(torch.float64).numpy()
    per_layer = values.mean(axis=1) if values.shape[1] else values.sum(axis=1)

    fig = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    bottom = _label_margin(token_labels, height) if token_labels is not None else 0.11
    grid = fig.add_gridspec(1, 2, width_ratios=(3, 1), wspace=0.3, bottom=bottom)
    heat = fig.add_subplot(grid[0])
    image = heat.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
    heat.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    heat.set_xlabel("token position")
    if token_labels is not None:
        _label_tokens(heat, token_labels, width, decode_start)
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
    return fig


def axis_token_labels(heat: Axes) -> tuple[str, ...]:
    """The token labels the heatmap shows, as ``"position:label"`` (read back from the axis)."""
    return tuple(f"{int(round(x))}:{label.get_text()}" for x, label in zip(heat.get_xticks(), heat.get_xticklabels()))


def _label_tokens(heat: Axes, labels: Sequence[str], width: int, decode_start: int | None) -> None:
    """Label the token axis: every token while they fit, else every ``k``-th (and the first
    decode token). Labels are drawn as plain text (no ``$...$`` math), vertical."""
    fit = max(1, int(width * _HEAT_SHARE / _LABEL_PIXELS))
    step = max(1, -(-len(labels) // fit))
    ticks = set(range(0, len(labels), step))
    if decode_start is not None and 0 < decode_start < len(labels):
        ticks = {t for t in ticks if abs(t - decode_start) >= step} | {decode_start}
    ticks = sorted(ticks)
    heat.set_xticks(ticks, [_cut(labels[t]) for t in ticks], rotation=90, fontsize=7)
    for label in heat.get_xticklabels():
        label.set_parse_math(False)
    heat.set_xlabel("token" + ("" if step == 1 else f" (one label every {step})"))


def _cut(label: str) -> str:
    return label if len(label) <= MAX_LABEL_CHARS else label[: MAX_LABEL_CHARS - 1] + "…"


def _label_margin(labels: Sequence[str], height: int) -> float:
    """The share of the figure's height below the heatmap that vertical labels need."""
    chars = max((len(_cut(label)) for label in labels), default=1)
    return min(0.5, (chars * 5 + 45) / height)


def _mark_decode_start(heat: Axes, decode_start: int, n_tokens: int) -> None:
    """The prefill/decode boundary: a dashed line between the two phases' cells."""
    if not 0 < decode_start < n_tokens:
        raise InvalidArgumentError(f"decode_start {decode_start} is not inside the {n_tokens} plotted tokens")
    heat.axvline(decode_start - 0.5, color=BOUNDARY_COLOR, linestyle="--", linewidth=2)
    heat.set_xlabel(heat.get_xlabel() + " (dashed: decode starts)")
