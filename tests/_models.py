"""Tiny randomly initialised models for the capture tests (no weights are downloaded)."""

from __future__ import annotations

import threading

import torch

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny(kind: str = "llama", *, attn: str = "sdpa", dtype=torch.float32, seed: int = 0, **over):
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=128,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **over)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cls_cfg, cls_model = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
            "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
            "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
            "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
            "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
            "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
            "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),
            "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
            "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
            "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM),
            "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
            "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
            "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
        }[kind]
        kw = dict(SMALL)
        if kind in ("mixtral", "gpt_oss"):
            kw.update(num_local_experts=4, num_experts_per_tok=2)
        if kind == "qwen2_moe":  # every layer sparse (decoder_sparse_step 1), each with its shared expert
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24)
        if kind == "qwen3_moe":
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)
        if kind == "olmoe":
            kw.update(num_experts=4, num_experts_per_tok=2, eos_token_id=None)
        if kind in ("qwen3", "gemma", "gemma2", "gemma3_text", "gpt_oss"):
            kw.update(head_dim=8)
        if kind == "gpt_oss":  # its defaults name token ids past the tiny vocabulary; YaRN from 4 positions
            kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4})
        if kind == "phi3":  # its defaults name token ids past the tiny vocabulary
            kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if kind == "gpt_neox":  # no grouped-query attention: every head has its own k and v
            kw.pop("num_key_value_heads")
        if kind in ("olmo2", "olmo3", "smollm3"):  # their defaults name token ids past the tiny vocabulary
            kw.update(pad_token_id=0, bos_token_id=None, eos_token_id=2)
        if kind == "granite":  # multipliers that change every value they touch, as Granite 3's do
            kw.update(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                      attention_multiplier=0.0078125)
        if kind == "smollm3":  # every other layer without RoPE (NoPE), as SmolLM3 has every fourth
            kw.update(no_rope_layer_interval=2)
        if kind in ("gemma2", "gemma3_text", "olmo3", "gpt_oss"):  # a window shorter than the tests' prompts
            kw.update(sliding_window=5)
        if kind in ("gemma2", "gpt_oss") and attn == "sdpa":  # transformers has no sdpa for them (soft-capping, sinks)
            attn = "eager"
        kw.update(over)
        if kind in ("olmo3", "gpt_oss") and "layer_types" not in kw:  # sliding and full layers in turn
            kw["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(kw["num_hidden_layers"])]
        model = cls_model(cls_cfg(**kw))
    model = model.to(dtype).eval()
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id = 0
    return model


def left_padded_batch(lengths=(7, 4, 6), vocab=97, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, t - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, t - n:] = 1
    return ids, mask


class MemoryWriter:
    """Stands in for the pack writer where a test needs to see records without storage."""

    def __init__(self, on_seal=None, fail_after=None):
        self.records = []
        self.on_seal = on_seal
        self.fail_after = fail_after
        self.sealed = 0
        self.layouts = {}  # key -> (token_axis, key_axis), as the drain declared them

    def append(self, key, data, *, shard=None, token_axis=0, key_axis=None):
        if self.fail_after is not None and len(self.records) >= self.fail_after:
            raise RuntimeError("disk on fire")
        self.records.append((key, data.clone(), shard))
        self.layouts[key] = (token_axis, key_axis)

    def seal(self):
        self.sealed += 1
        return None

    def close(self):
        pass

    def by(self, hook, request_id=None):
        return [(k, d) for k, d, _ in self.records if k.hook == hook and (request_id is None or k.request_id == request_id)]


class GatedWriter(MemoryWriter):
    """Holds the drain thread inside its first append until the test opens ``gate``: the ring's
    slots stay taken, so the next reservation waits or is dropped, every run (no timer, no race)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def append(self, key, data, *, shard=None, token_axis=0, key_axis=None):
        self.gate.wait(30)
        super().append(key, data, shard=shard, token_axis=token_axis, key_axis=key_axis)
