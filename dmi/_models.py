"""Models to capture from: built-in tiny configs for trying DMI out, a real trained model
(``smollm2``), or a local HF directory.

The built-in models are built from a ``transformers`` config with random weights drawn
from a fixed seed, so they need no download and give the same weights on every machine
and every run. Their tokenizer is a byte-level BPE with no merges, built in memory: any
text tokenizes (one token per UTF-8 byte), nothing is fetched.

The real model (``smollm2``, see ``dmi._real_model``) comes from an installed package,
converted once and cached in the DMI home.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from dmi._real_model import REAL_MODELS, reading, say_on_stderr
from dmi.storage.errors import InvalidArgumentError, ModelCacheError

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "LoadedModel", "load_model", "model_progress", "byte_tokenizer"]


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A small Llama-style geometry that runs in milliseconds on a CPU.

    Weights are ``dtype`` (bfloat16 by default, as models are usually served), so what is
    captured compresses like real activations do, not like float32 noise.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    seed: int = 0
    dtype: str = "bfloat16"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-llama": BuiltinModel("tiny-llama", 64, 176, 4, 4, 2),
    "small-llama": BuiltinModel("small-llama", 256, 688, 8, 8, 4),
}
"""Built-in model names accepted wherever a model directory is (``dmi capture --model``)."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for ``dmi.capture`` with its tokenizer and the name it came from."""

    model: Any
    tokenizer: Any
    source: str


_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over raw UTF-8 bytes: 256 byte tokens plus ``<pad>``, ``<s>``, ``</s>``.

    Left padding (what batched generation needs), ``<s>`` prepended to every text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*_SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", padding_side="left"
    )


def _build_builtin(spec: BuiltinModel) -> LoadedModel:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="eager",
    )
    # Seed a private generator so the weights do not depend on (or disturb) global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, spec.dtype))
    model.config.name_or_path = spec.name
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model.eval(), tokenizer, spec.name)


def model_progress(*, quiet: bool) -> Callable[[str], None]:
    """Where a command sends a model's one-time conversion lines: stderr, or nowhere when quiet."""
    return (lambda line: None) if quiet else say_on_stderr


def load_model(
    name_or_dir: str,
    *,
    attn_implementation: str | None = None,
    home: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] = say_on_stderr,
) -> LoadedModel:
    """A built-in model by name (see ``BUILTIN_MODELS``), the real model ``"smollm2"``, or a
    local HF model directory.

    Directories load through ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` (local files only: nothing is downloaded), with the
    tokenizer padding on the left (what batched generation needs).
    ``attn_implementation`` (``"eager"``, ``"sdpa"``, ...) is passed to ``from_pretrained``;
    built-in models always use eager attention so that ``attn_pattern`` can be captured.

    ``"smollm2"`` (SmolLM2-135M-Instruct, float32, its own tokenizer) is read from its
    cache in ``home`` (default: the DMI home, ``$DMI_HOME`` else ``~/.local/share/dmi``),
    ``HOME/models/smollm2``; the first load converts the installed package's GGUF file
    into that cache (about a minute, one line per stage to ``progress``, stderr by
    default). Its model id when captured is ``smollm2``.

    Returns a ``LoadedModel`` (model in eval mode, tokenizer, the name it came from).
    Raises ``InvalidArgumentError`` when the name is neither built in, real, nor an existing
    directory, when the directory holds no ``config.json`` or cannot be loaded (the reason is
    in the message), or when a built-in model is asked for an attention implementation other
    than eager;
    ``ModelNotInstalledError`` (with the ``pip install`` command) when ``smollm2``'s
    package is absent and not cached yet; ``ModelCacheError`` when its cache cannot be
    written or loaded; ``ModelError`` when transformers cannot convert the package's file.
    """
    spec = BUILTIN_MODELS.get(name_or_dir)
    if spec is not None:
        if attn_implementation not in (None, "eager"):
            raise InvalidArgumentError(
                f"built-in model {name_or_dir!r} always uses eager attention; "
                f"attn_implementation={attn_implementation!r} applies to a model directory"
            )
        return _build_builtin(spec)
    real = REAL_MODELS.get(name_or_dir)
    if real is not None:
        with reading(real, home=home, progress=progress) as folder:  # a reconversion waits for this load
            return _load_real(real.name, folder, attn_implementation)
    if not os.path.isdir(name_or_dir):
        known = ", ".join([*BUILTIN_MODELS, *REAL_MODELS])
        raise InvalidArgumentError(
            f"model {name_or_dir!r} is neither a local model directory nor a built-in model ({known})"
        )
    if not os.path.isfile(os.path.join(name_or_dir, "config.json")):
        raise InvalidArgumentError(
            f"{name_or_dir} is a directory but not a Hugging Face model directory (it holds no config.json); "
            "write one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)"
        )
    try:
        return _load_directory(name_or_dir, attn_implementation)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot load a causal LM from {name_or_dir}: {exc}") from exc


def _load_real(name: str, folder: os.PathLike[str], attn_implementation: str | None) -> LoadedModel:
    """A real model from its cache ``folder``, named ``name`` (its model id when captured)."""
    from safetensors import SafetensorError

    try:
        loaded = _load_directory(folder, attn_implementation)
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelCacheError(
            f"the {name} cache in {folder} cannot be loaded ({exc}); remove that directory "
            "and load again to convert the model anew"
        ) from exc
    loaded.model.config.name_or_path = name
    return LoadedModel(loaded.model, loaded.tokenizer, name)


def _load_directory(folder: str | os.PathLike[str], attn_implementation: str | None) -> LoadedModel:
    """``from_pretrained`` of a local directory's model and tokenizer (left padding, a pad
    token); raises what transformers raises (``OSError``, ``ValueError``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side="left")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **extra)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model.eval(), tokenizer, str(folder))
