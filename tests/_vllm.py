"""The vLLM tests' model and engine: a tiny Llama built from a config with DMI's byte tokenizer,
saved as a Hugging Face directory that both vLLM and transformers load.

vLLM's CPU attention needs a head size it has kernels for (64 here; 16 is refused), and a KV
block size that is a multiple of 32.

``python -m tests._vllm capture MODEL_DIR HOME HOOKS`` captures ``PROMPTS`` in a fresh process
(an engine that must be the first of its process) and prints, as the last line, a JSON object:
the tokens each request ran and the error a ``mlp_post`` attach raised.
"""

from __future__ import annotations

import json
import os
import sys

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


def tiny_mixtral_dir(root) -> str:
    """A 2-layer Mixtral (4 experts, 2 per token) with the same attention shapes."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from dmi._models import byte_tokenizer

    tok = byte_tokenizer()
    config = MixtralConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MixtralForCausalLM(config).eval()
    path = str(root / "tiny-mixtral-vllm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_llm(model_dir: str, **over):
    from vllm import LLM

    return LLM(model=model_dir, **{**ENGINE, "max_model_len": 256, **over})


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _capture_in_this_process(model_dir: str, home: str, hooks: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    import dmi

    llm = build_llm(model_dir)
    params = vllm.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with dmi.open(home=home) as store:
        with store.capture_vllm(llm, hooks=hooks) as cap:
            outs = cap.generate(PROMPTS, params)
        try:
            with store.capture_vllm(llm, hooks="mlp_post"):
                refused = ""
        except dmi.DMIError as exc:
            refused = f"{type(exc).__name__}: {exc}"
    fed = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:-1]) for o in outs}
    return {"fed": fed, "refused": refused}


if __name__ == "__main__":
    if sys.argv[1:2] != ["capture"] or len(sys.argv) != 5:
        sys.exit("usage: python -m tests._vllm capture MODEL_DIR HOME HOOKS")
    print(json.dumps(_capture_in_this_process(*sys.argv[2:])))
