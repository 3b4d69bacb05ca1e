"""The prefill/decode boundary comes back with a read (``LazyInternal.phases``,
``RequestContents.phases``), in ``dmi show``, and as a line on ``dmi plot``'s token axis."""

from __future__ import annotations

import json

import pytest
import torch

import dmi
from dmi._plot import BOUNDARY_COLOR, write_norm_plot
from dmi._values import PhaseSpan
from dmi.cli import main
from dmi.storage.errors import InvalidArgumentError

from ._models import left_padded_batch, tiny

LENGTHS = (7, 4, 6)
N_NEW = 4  # tokens generated; the last one is never fed back, so N_NEW - 1 decode positions


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("phases")
    model = tiny("llama")
    ids, mask = left_padded_batch(LENGTHS)
    with dmi.open(home=home) as store:
        with store.capture(model, hooks="resid_post logits token_ids", model_id="m", decode_chunk_steps=1) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                         request_ids=["g0", "g1", "g2"])
            cap.forward(ids[:1], attention_mask=mask[:1], request_ids=["f0"])
    return home


@pytest.mark.parametrize("row", range(len(LENGTHS)))
def test_a_read_says_which_positions_were_prefill_and_which_decode(home, row):
    prompt = LENGTHS[row]
    rid = f"g{row}"
    with dmi.open(home=home) as store:
        view = store.lazy("m", rid, "resid_post")
        # one record per decode step (decode_chunk_steps=1): consecutive decode records merge into one span
        assert view.phases == (PhaseSpan("prefill", 0, prompt), PhaseSpan("decode", prompt, prompt + N_NEW - 1))
        assert view.decode_start == prompt
        assert view.shape[1] == prompt + N_NEW - 1  # the spans cover the read's token axis exactly
        # a read of one layer keeps the same axis
        assert store.lazy("m", rid, "resid_post", layers=[2]).phases == view.phases
        # logits: the model materialises the prompt's last position, then one per step
        logits = store.lazy("m", rid, "logits")
        assert logits.phases == (PhaseSpan("prefill", 0, 1), PhaseSpan("decode", 1, N_NEW))
        assert logits.shape[0] == N_NEW
        # the request in its own token positions (token_ids: every position fed to the model)
        contents = store.contents("m", rid)
        assert contents.phases == (PhaseSpan("prefill", 0, prompt), PhaseSpan("decode", prompt, prompt + N_NEW - 1))
        tokens = store.get_internal("m", rid, "token_ids")
        assert tokens.shape[0] == contents.phases[-1].stop
        assert contents.decode_start == prompt and logits.decode_start == 1
        assert contents.as_dict()["phases"][0] == {"phase": "prefill", "start": 0, "stop": prompt}


def test_a_scoring_pass_is_one_forward_span(home):
    with dmi.open(home=home) as store:
        assert store.lazy("m", "f0", "resid_post").phases == (PhaseSpan("forward", 0, LENGTHS[0]),)
        assert store.contents("m", "f0").decode_start is None
        assert store.lazy("m", "f0", "resid_post").decode_start is None


def test_show_and_plot_mark_the_boundary(home, tmp_path, capsys):
    assert main(["show", "m", "g1", "--home", str(home)]) == 0
    assert f"token positions: prefill 0-{LENGTHS[1] - 1}, decode {LENGTHS[1]}-{LENGTHS[1] + N_NEW - 2}" in capsys.readouterr().out
    png = tmp_path / "g1.png"
    assert main(["plot", "m", "g1", "-o", str(png), "--json", "--home", str(home)]) == 0
    drawn = json.loads(capsys.readouterr().out)
    assert drawn["decode_start"] == LENGTHS[1]
    assert _red_columns(png)  # the line is on the image
    assert main(["plot", "m", "f0", "-o", str(png), "--json", "--home", str(home)]) == 0
    assert json.loads(capsys.readouterr().out)["decode_start"] is None
    assert not _red_columns(png)  # a scoring pass has no boundary to draw


def _red_columns(path) -> list[int]:
    from matplotlib.image import imread

    rgb = torch.from_numpy(imread(path)[..., :3].copy())
    red = torch.tensor(_rgb(BOUNDARY_COLOR))
    return sorted(set((rgb - red).abs().amax(-1).lt(1e-3).nonzero()[:, 1].tolist()))


def _rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_plot_draws_the_boundary_between_the_last_prefill_and_first_decode_cell(tmp_path):
    from matplotlib.image import imread

    n_tokens, boundary = 10, 4
    norms = torch.ones(3, n_tokens, dtype=torch.float64)  # one colour: the heatmap is a plain block
    path = tmp_path / "p.png"
    drawn = write_norm_plot(norms, [0, 1, 2], path, title="t", decode_start=boundary)
    assert drawn.decode_start == boundary
    cols = _red_columns(path)
    assert cols and cols[-1] - cols[0] <= 3  # one thin vertical line
    rgb = torch.from_numpy(imread(path)[..., :3].copy())
    row = rgb[rgb.shape[0] // 2]
    colours, counts = row[row.amin(-1) < 0.99].unique(dim=0, return_counts=True)
    cell = colours[counts.argmax()]  # the heatmap's one colour: the widest block of the row
    line = (cols[0] + cols[-1]) / 2
    cells = ((row - cell).abs().amax(-1) < 2e-2).nonzero().flatten().tolist()
    runs, gap = [[cells[0]]], 4  # the heatmap and the colour bar: runs of the colour, the line a small gap
    for x in cells[1:]:
        if x - runs[-1][-1] <= gap:
            runs[-1].append(x)
        else:
            runs.append([x])
    heat = next(r for r in runs if r[0] - gap <= line <= r[-1] + gap)
    left, right = heat[0], heat[-1] + 1
    assert right - left > 100  # the run is the heatmap, not a sliver beside the line
    expected = left + (right - left) * boundary / n_tokens
    assert abs(line - expected) <= 1.5
    write_norm_plot(norms, [0, 1, 2], path, title="t")
    assert not _red_columns(path)
    with pytest.raises(InvalidArgumentError, match="not inside the 10 plotted tokens"):
        write_norm_plot(norms, [0, 1, 2], path, title="t", decode_start=10)
