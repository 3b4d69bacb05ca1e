"""The vLLM tests' model and engine: a tiny Llama built from a config with DMI's byte tokenizer,
saved as a Hugging Face directory that both vLLM and transformers load.

vLLM's CPU attention needs a head size it has kernels for (64 here; 16 is refused), and a KV
block size that is a multiple of 32.

:func:`capture_in_a_fresh_process` runs :func:`capture_in_this_process` in a new Python process
and reads its result back (JSON, through a file: vLLM logs to stdout);
:func:`run_child_in_a_fresh_process` does the same for a test module's own ``_child``.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import pytest
import torch

MARKS = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # vLLM's own, at import and at start
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]
"""Every vLLM test module's ``pytestmark``: marked ``vllm``, vLLM's warnings not turned into errors."""

ENGINE = dict(enforce_eager=True, dtype="float32", max_num_seqs=8, enable_prefix_caching=False)
"""The engine every capture test runs: eager (hooks run every step), no prefix cache."""

PROMPTS = [
    "hello there",
    "a much longer prompt that the scheduler has to split into chunks " * 2,
    "x",
]


def tiny_llama_dir(root, *, hidden: int = 128, heads: int = 2, kv_heads: int = 1, layers: int = 3,
                   name: str = "tiny-llama-vllm") -> str:
    """A Llama with heads of 64 (default: 3 layers, hidden 128, 2 heads, 1 KV head), random
    weights from seed 0: :func:`tiny_family_dir` of ``"llama"``."""
    return tiny_family_dir(root, "llama", hidden=hidden, heads=heads, kv_heads=kv_heads, layers=layers, name=name)


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


FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=64, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=64, tie_word_embeddings=True, sliding_window=32)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=64, tie_word_embeddings=True, sliding_window=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                     logits_scaling=8.0, attention_multiplier=0.0078125)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(tie_word_embeddings=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=64, tie_word_embeddings=False, sliding_window=32, num_local_experts=4,
                     num_experts_per_tok=2,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 512})),
}
"""Per model type: its config and model classes, and what differs from the defaults of
:func:`tiny_family_dir` (Gemma's models tie their embeddings, as vLLM's Gemma classes assume;
Gemma 2/3's window of 32 is shorter than :data:`PROMPTS`' long prompt, so it is used;
Granite's multipliers are Granite 3's magnitudes, so each changes every value it touches;
gpt-oss keeps its default layer types, sliding and full in turn, which is the order vLLM's
class assumes, and YaRN over the 512 positions; GPT-2 has no grouped KV heads and its MLP's width is
``n_inner``, so its config is given its own names for those)."""


def tiny_family_dir(root, model_type: str, *, hidden: int = 128, heads: int = 2, kv_heads: int = 1,
                    layers: int = 3, name: str | None = None) -> str:
    """A model of ``model_type`` (a key of :data:`FAMILY_CONFIGS`) with heads of 64 (default:
    the tiny Llama's 3 layers, hidden 128, 2 heads, 1 KV head), random weights from seed 0."""
    import transformers

    from dmi._models import byte_tokenizer

    config_name, model_name, over = FAMILY_CONFIGS[model_type]
    tok = byte_tokenizer()
    widths = (dict(n_inner=2 * hidden) if model_type == "gpt2"
              else dict(intermediate_size=2 * hidden, num_key_value_heads=kv_heads))
    config = getattr(transformers, config_name)(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        max_position_embeddings=512, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, **widths, **over,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config).eval()
    path = str(root / (name or f"tiny-{model_type}-vllm"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama's directory, once per test module."""
    return tiny_llama_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def llm(model_dir):
    """An engine on it in this process, 64 tokens a step (long prompts are chunked)."""
    return build_llm(model_dir, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf(model_dir):
    """The same weights in transformers: the reference."""
    return hf_model(model_dir)


@pytest.fixture
def store(tmp_path):
    """A store of its own per test."""
    import dmi

    with dmi.open(home=tmp_path / "home") as s:
        yield s


def build_llm(model_dir: str, **over):
    """An engine in this process. Engines no test holds any more are finalized first: one
    finalized later, by a collection during the new engine's life, tears down vLLM's
    process-global parallel state under it ("pipeline model parallel group is not
    initialized" at its next step; test_vllm_audit.py then test_vllm_guards.py did that)."""
    from vllm import LLM

    gc.collect()
    return LLM(model=model_dir, **{**ENGINE, "max_model_len": 256, **over})


def hf_model(model_dir: str, **over):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **over).eval()


def capture_in_this_process(spec: dict) -> dict:
    """Build an engine (``spec["engine"]`` over :data:`ENGINE`, ``spec["env"]`` set first),
    capture ``PROMPTS`` with ``spec["hooks"]`` into the store at ``spec["home"]``; then try
    ``spec["refuse_hooks"]`` if given. Returns the tokens each request ran, the session's
    statistics and the errors (``"Type: message"``) raised."""
    os.environ.update(spec.get("env", {}))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    import dmi

    if "native" in spec:
        return _native_in_this_process(spec)
    llm = build_llm(spec["model"], **spec.get("engine", {}))
    params = vllm.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    result: dict = {"fed": {}, "stats": None, "error": "", "refused": ""}
    with dmi.open(home=spec["home"]) as store:
        try:
            with store.capture_vllm(llm, hooks=spec["hooks"]) as cap:
                outs = cap.generate(PROMPTS, params)
            result["stats"] = cap.stats
            result["fed"] = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:-1]) for o in outs}
        except dmi.DMIError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        if spec.get("refuse_hooks"):
            try:
                with store.capture_vllm(llm, hooks=spec["refuse_hooks"]):
                    pass
            except dmi.DMIError as exc:
                result["refused"] = f"{type(exc).__name__}: {exc}"
    return result


def capture_each_model(spec: dict, refuse: tuple[str, ...] = ()) -> dict:
    """In this process, per model of ``spec["models"]`` (name → directory): an engine, the hooks
    ``all_but_patterns token_ids`` gives it and a capture of :data:`PROMPTS` (run id = the name)
    into the store at ``spec["home"]``, or the error that stopped it; then each hook of
    ``refuse`` attached alone (``""``, or the error that refused it)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    import dmi

    result = {}
    with dmi.open(home=spec["home"]) as store:
        for name, path in spec["models"].items():
            llm = build_llm(path, max_num_batched_tokens=64)
            params = vllm.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            got = {"hooks": {}, "rids": [], "error": "", "refused": {}}
            try:
                with store.capture_vllm(llm, hooks="all_but_patterns token_ids", run_id=name) as cap:
                    got["hooks"] = {h: list(v) for h, v in cap.hooks.items()}
                    got["rids"] = [o.request_id for o in cap.generate(PROMPTS, params)]
            except dmi.DMIError as exc:
                got["error"] = f"{type(exc).__name__}: {exc}"
            for hook in refuse:
                try:
                    with store.capture_vllm(llm, hooks=hook):
                        got["refused"][hook] = ""
                except dmi.DMIError as exc:
                    got["refused"][hook] = f"{type(exc).__name__}: {exc}"
            result[name] = got
            del llm
            gc.collect()
    return result


def _native_in_this_process(spec: dict) -> dict:
    """vLLM's own extractor (``extract_hidden_states``, layers ``spec["native"]["layers"]``)
    through the benchmark's CPU-safe connector (``bench/_vllm_native.py``: the stock one needs
    CUDA) on ``PROMPTS``, greedy: the engine is stepped until the finished requests' files are
    written. Returns each request's tokens and file."""
    import vllm

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    native = spec["native"]
    draft = {"hf_config": {"eagle_aux_hidden_state_layer_ids": native["layers"]}}
    llm = build_llm(spec["model"], speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                                       "draft_model_config": draft},
                    kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector", "kv_role": "kv_producer",
                                        "kv_connector_module_path": "_vllm_native",
                                        "kv_connector_extra_config": {"shared_storage_path": native["dir"]}})
    params = vllm.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                 extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    outs = llm.generate(PROMPTS, params)
    core = llm.llm_engine.engine_core.engine_core
    while core.scheduler.has_requests():  # the files are written on the step after a request finished
        llm.llm_engine.step()
    return {"fed": {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:-1]) for o in outs},
            "files": {o.request_id: o.kv_transfer_params["hidden_states_path"] for o in outs}}


def run_child_in_a_fresh_process(module: str, spec: dict, out: str, timeout: float = 600) -> dict:
    """``module._child(spec_json, out)`` (a test module's own capture) in a new Python process
    started in the repository's root, its JSON result read back from ``out``."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import sys; from {module} import _child; _child(sys.argv[1], sys.argv[2])"
    child = subprocess.run([sys.executable, "-c", code, json.dumps(spec), out], cwd=root, capture_output=True,
                           text=True, timeout=timeout)
    if child.returncode != 0:
        raise AssertionError(f"the capture process failed ({child.returncode}):\n{child.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def _child(spec_json: str, out: str) -> None:
    """:func:`capture_in_this_process` of ``spec_json``, its result written to ``out`` as JSON:
    what :func:`capture_in_a_fresh_process` runs in the new process."""
    with open(out, "w") as f:
        json.dump(capture_in_this_process(json.loads(spec_json)), f)


def capture_in_a_fresh_process(spec: dict, timeout: float = 600) -> dict:
    """:func:`capture_in_this_process` in a new Python process (an engine that must be the first
    of its process, or one that runs its own worker processes), its result read back."""
    return run_child_in_a_fresh_process("tests._vllm", spec, spec["home"] + "-result.json", timeout)
