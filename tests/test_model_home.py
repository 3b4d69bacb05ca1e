"""The CLI loads a model (the ``smollm2`` cache) from the home of the store it uses: ``--home``
beats ``$DMI_HOME``; ``--catalog``/``--packs`` alone leave the default home. ``load_model`` is
spied on, so the real model is never converted here."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

import dmi
import dmi._models as models_module
from dmi.cli import main


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """Records the ``home`` every ``load_model`` call gets; the environment's home is ``hA``."""
    for name in ("DMI_CATALOG", "DMI_PACKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DMI_HOME", str(tmp_path / "hA"))
    seen = []
    real = models_module.load_model

    def recording_load_model(name_or_dir, **options):
        seen.append(options.get("home"))
        return real(name_or_dir, **options)

    monkeypatch.setattr(models_module, "load_model", recording_load_model)
    return seen


def _cli(*argv: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*argv, "--json", "-q"])
    assert (rc, err.getvalue()) == (0, "")
    return json.loads(out.getvalue())


def _capture(*where: str) -> dict:
    return _cli("capture", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "0", *where)


def test_capture_and_audit_use_the_home_flag(tmp_path, homes):
    home_b = str(tmp_path / "hB")
    result = _capture("--home", home_b)
    _cli("audit", result["model_id"], "--model", "tiny-llama", "--home", home_b)
    assert homes == [str(Path(home_b).resolve())] * 2


def test_demo_uses_the_home_flag(tmp_path, homes):
    report = _cli("demo", "--home", str(tmp_path / "hB"))
    assert report["home"] == str((tmp_path / "hB").resolve())
    assert homes == [report["home"]]


def test_catalog_and_packs_alone_keep_the_default_home(tmp_path, homes):
    _capture("--catalog", "chdb://" + str(tmp_path / "cat"), "--packs", str(tmp_path / "packs"))
    assert homes == [str((tmp_path / "hA").resolve())]


def test_store_audit_by_name_uses_the_store_home(tmp_path, homes):
    home_b = tmp_path / "hB"
    result = _capture("--home", str(home_b))
    with dmi.open(home=home_b) as store:
        report = store.audit(result["model_id"], model="tiny-llama", record=False)
    assert report.passed
    assert homes == [str(home_b.resolve())] * 2
