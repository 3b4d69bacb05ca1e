"""An export's manifest says, per feature, which codec its values were stored with and how
much a lossy one lost, so a trainer reading the files knows when they are decoded
approximations.

A tiny randomly initialised Llama (``tests/_models.py``) is captured for real into a chDB
catalog: ``resid_post`` with the lossy ``int8`` codec (run ``lossy``) and ``fp8`` (run
``fp8``), ``mlp_out`` with the writer's lossless default. The manifest's figures are compared,
exactly, with the catalog's rows of the same records.
"""

from __future__ import annotations

import json

import pytest
import torch

import dmi
from tests._models import left_padded_batch, tiny


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path_factory.mktemp("export-lossy")) as opened:
        for run, codec in (("lossy", "int8"), ("fp8", "fp8")):
            with opened.capture(model, hooks="resid_post mlp_out", layers=[0, 1], model_id="m", run_id=run,
                                codec={"resid_post": codec}) as cap:
                with torch.inference_mode():
                    cap.forward(ids, attention_mask=mask)
        yield opened


def _catalog_rows(store, runs: tuple[str, ...]) -> dict[str, dict]:
    """Per feature name, the catalog's codecs and worst errors over the records of ``runs``."""
    catalog = store.catalog
    rows = catalog.sql(
        f"SELECT hook, layer, groupUniqArray(codec) AS codecs, max(codec_max_abs_error) AS max_abs, "
        f"max(codec_rel_l2_error) AS rel_l2 FROM {catalog.tables['records_published']} "
        f"WHERE model_id = 'm' AND run_id IN ({', '.join(map(repr, runs))}) GROUP BY hook, layer").to_pylist()
    return {f"{r['hook']}.{r['layer']}": r for r in rows}


def _manifest(store, tmp_path, **options) -> dict:
    loader = store.loader("m", batch_size=5, **options)
    return json.loads(loader.export(tmp_path / "out").read_text())


def test_a_lossy_export_names_its_codec_and_the_catalogs_worst_error(store, tmp_path):
    manifest = _manifest(store, tmp_path, hooks=["resid_post", "mlp_out"], layers=[0, 1], runs=["lossy", "fp8"])
    catalog = _catalog_rows(store, ("lossy", "fp8"))
    assert manifest["lossy"] is True
    assert set(manifest["codecs"]) == set(catalog) == {"resid_post.0", "resid_post.1", "mlp_out.0", "mlp_out.1"}
    for name, row in catalog.items():
        assert manifest["codecs"][name] == {"codecs": sorted(row["codecs"]), "lossy": name.startswith("resid_post"),
                                            "max_abs_error": row["max_abs"], "rel_l2_error": row["rel_l2"]}
    assert manifest["codecs"]["resid_post.0"]["codecs"] == ["fp8", "int8"]
    lossy, lossless = manifest["codecs"]["resid_post.1"], manifest["codecs"]["mlp_out.0"]
    assert lossy["max_abs_error"] > 0 and lossy["rel_l2_error"] > 0
    assert lossless["max_abs_error"] == lossless["rel_l2_error"] == 0.0


def test_the_worst_error_is_the_selections_own(store, tmp_path):
    """One run's records only: the figures are that run's, not the other run's worse or better ones."""
    manifest = _manifest(store, tmp_path, hooks="resid_post", layers=[1], runs="lossy")
    row, both = _catalog_rows(store, ("lossy",))["resid_post.1"], _catalog_rows(store, ("lossy", "fp8"))["resid_post.1"]
    assert (row["max_abs"], row["rel_l2"]) != (both["max_abs"], both["rel_l2"])
    assert manifest["codecs"] == {"resid_post.1": {"codecs": ["int8"], "lossy": True, "max_abs_error": row["max_abs"],
                                                   "rel_l2_error": row["rel_l2"]}}
    assert manifest["lossy"] is True


def test_a_lossless_export_says_so(store, tmp_path):
    manifest = _manifest(store, tmp_path, hooks="mlp_out", layers=[0, 1])
    (codec,) = {c for row in _catalog_rows(store, ("lossy", "fp8")).values() for c in row["codecs"]} - {"int8", "fp8"}
    assert manifest["lossy"] is False
    assert manifest["codecs"] == {f"mlp_out.{layer}": {"codecs": [codec], "lossy": False, "max_abs_error": 0.0,
                                                       "rel_l2_error": 0.0} for layer in (0, 1)}


def test_an_error_that_is_not_a_number_gives_no_bound():
    """A record whose values held a NaN has NaN errors (``tests/test_lossy_codecs.py``): the
    manifest says ``null`` rather than a bound taken from the other records."""
    from dmi._export import worst_error

    assert worst_error([0.25, float("nan"), 2.0]) is None
    assert worst_error([0.25, 2.0, 1.0]) == 2.0
    assert worst_error([]) == 0.0
