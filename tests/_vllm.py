"""The vLLM tests' model and engine: a tiny Llama built from a config with DMI's byte tokenizer,
saved as a Hugging Face directory that both vLLM and transformers load.

vLLM's CPU attention needs a head size it has kernels for (64 here; 16 is refused), and a KV
block size that is a multiple of 32.
"""

from __future__ import annotations

import torch

ENGINE = dict(enforce_eager=True, dtype="float32", max_num_seqs=8, enable_prefix_caching=False)
"""The engine every capture test runs: eager (hooks run every step), no prefix cache."""

PROMPTS = [
    "hello there",
    "a much longer prompt that the scheduler has to split into chunks " * 2,
    "x",
]


def tiny_llama_dir(root) -> str:
    """A 3-layer Llama (hidden 128, 2 heads of 64, 1 KV head), random weights from seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmi._models import byte_tokenizer

    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    path = str(root / "tiny-llama-vllm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_llm(model_dir: str, **over):
    from vllm import LLM

    return LLM(model=model_dir, **{**ENGINE, "max_model_len": 256, **over})


def hf_model(model_dir: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
