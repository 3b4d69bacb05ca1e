"""Models to capture from: built-in tiny configs for trying DMI out, or a local HF directory.

The built-in models are built from a ``transformers`` config with random weights drawn
from a fixed seed, so they need no download and give the same weights on every machine
and every run. Their tokenizer is a byte-level BPE with no merges, built in memory: any
text tokenizes (one token per UTF-8 byte), nothing is fetched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dmi.storage.errors import InvalidArgumentError

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "LoadedModel", "load_model", "byte_tokenizer"]


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


def load_model(name_or_dir: str, *, attn_implementation: str | None = None) -> LoadedModel:
    """A built-in model by name (see ``BUILTIN_MODELS``) or a local HF model directory.

    Directories load through ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` (local files only: nothing is downloaded).
    ``attn_implementation`` (``"eager"``, ``"sdpa"``, ...) is passed to ``from_pretrained``;
    built-in models always use eager attention so that ``attn_pattern`` can be captured.
    Raises ``InvalidArgumentError`` when the name is neither built in nor an existing
    directory, when the directory cannot be loaded (the reason is in the message), or when
    a built-in model is asked for an attention implementation other than eager.
    """
    spec = BUILTIN_MODELS.get(name_or_dir)
    if spec is not None:
        if attn_implementation not in (None, "eager"):
            raise InvalidArgumentError(
                f"built-in model {name_or_dir!r} always uses eager attention; "
                f"attn_implementation={attn_implementation!r} applies to a model directory"
            )
        return _build_builtin(spec)
    if not os.path.isdir(name_or_dir):
        known = ", ".join(BUILTIN_MODELS)
        raise InvalidArgumentError(
            f"model {name_or_dir!r} is neither a local model directory nor a built-in model ({known})"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir, local_files_only=True, padding_side="left")
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(name_or_dir, local_files_only=True, **extra)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot load a causal LM from {name_or_dir}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model.eval(), tokenizer, name_or_dir)
