"""Tensor-parallel capture across processes: two real ranks (spawned, gloo), one embedded store.

One 2-rank run (module fixture) captures eight models — transformers' own TP for a tiny
Llama with 4 kv heads, Qwen2 with 2, Llama with 1 (k/v replicated), Mixtral (router
replicated), Gemma 2 with 2 (its own block table), GPT-NeoX (Pythia's parallel residual,
q/k/v cut per head out of one fused projection) and OLMo 2 with 2 (its plan leaves q/k/v and
``attn_z`` whole on every rank), plus a Llama sharded by hand and described with
``tp_layout=`` — generating from a left-padded batch (prefill + decode). The tests then read the
store in this process:

* replicated hooks equal the same TP run's ``output_hidden_states`` bit for bit, and were
  written once (by TP rank 0), except where every rank's copy was asked for;
* sharded hooks, merged, equal the projection computed here from the captured
  ``resid_pre``/``resid_mid`` with the full, unsharded weights (``atol=rtol=1e-5``: each
  rank computes its columns with a different matmul blocking) and the TP=1 capture of the
  same model (``atol=rtol=1e-4``: the all-reduce sums partial products in another order);
  each rank's shard equals its slice of the merged tensor;
* generated tokens are identical with and without capture, on both ranks, and to TP=1.

A second 2-rank run SIGKILLs rank 1 between sealing and publishing: rank 0's records are
published, a sharded read names the missing rank, and after ``recover()`` it reads complete.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import dmi
from dmi.storage.errors import MissingShardError, RecordNotFoundError
from tests._models import left_padded_batch, tiny
from tests._tp_harness import RankFailed, hand_layout, run_ranks, shard_llama_by_hand

WORLD = 2
RUN = "tp2"
GEN = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
DENSE_HOOKS = ["resid_pre", "resid_mid", "attn_q", "attn_k", "attn_v", "attn_z", "mlp_post", "resid_post", "logits"]
MOE_HOOKS = ["resid_pre", "resid_mid", "attn_q", "attn_k", "attn_v", "attn_z", "resid_post", "logits", "router_logits"]

# name: (model kind, config overrides, how it is sharded, hooks, tp_replicas)
CASES = {
    "llama-kv4": ("llama", dict(num_key_value_heads=4), "transformers", DENSE_HOOKS, "rank0"),
    "qwen2-kv2": ("qwen2", dict(num_key_value_heads=2), "transformers", DENSE_HOOKS, "rank0"),
    "llama-kv1": ("llama", dict(num_key_value_heads=1), "transformers", DENSE_HOOKS, "rank0"),
    "mixtral": ("mixtral", dict(num_key_value_heads=2), "transformers", MOE_HOOKS, "rank0"),
    "gemma2-kv2": ("gemma2", dict(num_key_value_heads=2), "transformers", DENSE_HOOKS, "rank0"),
    "pythia": ("gpt_neox", {}, "transformers", [h for h in DENSE_HOOKS if h != "resid_mid"], "rank0"),
    "olmo2-kv2": ("olmo2", dict(num_key_value_heads=2), "transformers", DENSE_HOOKS, "rank0"),
    "llama-hand": ("llama", dict(num_key_value_heads=4), "hand", DENSE_HOOKS, "all"),
}
SHARDED = {"attn_q": "heads", "attn_k": "kv", "attn_v": "kv", "attn_z": "heads", "mlp_post": "inter"}
WHOLE = {"olmo2-kv2": {"attn_q", "attn_k", "attn_v", "attn_z"}}
"""Per case, the hooks its TP plan leaves whole on every rank: OLMo 2 gathers q/k/v inside the
projections (its q/k norms span all heads) and splits ``o_proj``'s input inside the module."""


def _load_rank_model(path: str, how: str, rank: int):
    """This rank's model and the attach options that describe its sharding."""
    import transformers

    from dmi.capture import load_tensor_parallel

    if how == "transformers":
        model, options = load_tensor_parallel(path, WORLD, dtype=torch.float32), {}
    else:
        model = shard_llama_by_hand(transformers.AutoModelForCausalLM.from_pretrained(path), rank, WORLD)
        options = dict(tp_rank=rank, tp_size=WORLD, tp_layout=hand_layout(model.config, rank, WORLD))
    model.eval()
    return model, options


def _capture_cases(rank: int, world: int, home: str, paths: dict) -> dict:
    """On one rank: for every case, generate without capture, then with capture (and the
    hidden states transformers returns), into the shared store at ``home``."""
    ids, mask = left_padded_batch()
    out = {}
    with dmi.open(home=home) as store:
        for name, (_, _, how, hooks, replicas) in CASES.items():
            model, options = _load_rank_model(paths[name], how, rank)
            with torch.no_grad():
                plain = model.generate(input_ids=ids, attention_mask=mask, **GEN)
                with store.capture(model, hooks=hooks, model_id=name, run_id=RUN, tp_replicas=replicas,
                                   **options) as cap:
                    rids, res = cap.generate(ids, attention_mask=mask, output_hidden_states=True,
                                             return_dict_in_generate=True, **GEN)
            out[name] = dict(plain=plain, captured=res.sequences, request_ids=list(rids), ranks=(cap.tp_rank, cap.tp_size),
                             hidden=[[h.clone() for h in step] for step in res.hidden_states])
    return out


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Save the eight models, run both ranks once, capture TP=1 here; yield what the tests read."""
    import transformers

    root = tmp_path_factory.mktemp("tp")
    paths = {}
    for name, (kind, over, *_rest) in CASES.items():
        paths[name] = str(root / name)
        tiny(kind, **over).save_pretrained(paths[name])
    home = str(root / "home")
    results = run_ranks(_capture_cases, WORLD, root / "ranks", home, paths)
    for r in results:
        assert not isinstance(r, RankFailed) and not isinstance(r, int), r
    full = {name: transformers.AutoModelForCausalLM.from_pretrained(paths[name]).eval() for name in CASES}
    ids, mask = left_padded_batch()
    tp1 = {}
    with dmi.open(home=home) as store:
        for name, (_, _, _, hooks, _) in CASES.items():
            with torch.no_grad(), store.capture(full[name], hooks=hooks, model_id=name, run_id="tp1") as cap:
                rids, seq = cap.generate(ids, attention_mask=mask, **GEN)
            tp1[name] = dict(request_ids=list(rids), tokens=seq)
        yield dict(store=store, ranks=results, full=full, tp1=tp1, pads=mask.eq(0).sum(1).tolist())


def _hidden_as_record(hidden, layer: int, row: int, pad: int) -> torch.Tensor:
    """``output_hidden_states[layer]`` of one request over prefill + decode, padding stripped."""
    steps = [hidden[0][layer][row, pad:]] + [step[layer][row] for step in hidden[1:]]
    return torch.cat(steps)


def test_ranks_come_from_the_mesh_and_tokens_match_everywhere(tp_run):
    for name in CASES:
        per_rank = [r[name] for r in tp_run["ranks"]]
        assert [p["ranks"] for p in per_rank] == [(0, WORLD), (1, WORLD)]
        reference = tp_run["tp1"][name]["tokens"]
        for p in per_rank:
            assert torch.equal(p["plain"], p["captured"]), name
            assert torch.equal(p["captured"], reference), name


def test_replicated_hooks_equal_hidden_states_bit_for_bit_and_are_written_once(tp_run):
    store, pads = tp_run["store"], tp_run["pads"]
    for name, (*_, replicas) in CASES.items():
        rank0 = tp_run["ranks"][0][name]
        n_layers = len(rank0["hidden"][0]) - 1
        for row, rid in enumerate(rank0["request_ids"]):
            resid_pre = store.get_internal(name, rid, "resid_pre", run_id=RUN)
            resid_post = store.get_internal(name, rid, "resid_post", run_id=RUN)
            for layer in range(n_layers):
                assert torch.equal(resid_pre[layer], _hidden_as_record(rank0["hidden"], layer, row, pads[row])), name
            for layer in range(n_layers - 1):  # the last hidden state is after the final norm
                assert torch.equal(resid_post[layer], _hidden_as_record(rank0["hidden"], layer + 1, row, pads[row]))
        copies = store.sql("SELECT count() AS n FROM {records} WHERE model_id = '" + name
                           + "' AND run_id = 'tp2' AND hook = 'resid_pre' AND shard_rank = 1").column("n")[0].as_py()
        assert (copies > 0) == (replicas == "all"), name
        if replicas == "all":  # every rank's copy was kept: rank 1's equals the de-duplicated one
            rid = rank0["request_ids"][0]
            assert torch.equal(store.get_internal(name, rid, "resid_pre", run_id=RUN, shard_rank=1),
                               store.get_internal(name, rid, "resid_pre", run_id=RUN))


def _reference(full, hook: str, layer: int, resid_pre: torch.Tensor, resid_mid: torch.Tensor | None) -> torch.Tensor:
    """What ``hook`` is at ``layer``, computed with the full weights from the captured residuals."""
    if hasattr(full, "gpt_neox"):
        return _neox_reference(full, hook, layer, resid_pre)
    block = full.model.layers[layer]
    attn, cfg = block.self_attn, full.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    post_norms_only = cfg.model_type == "olmo2"  # OLMo 2 norms neither block's input
    x = resid_pre if post_norms_only else block.input_layernorm(resid_pre)
    if hook == "mlp_post":  # Gemma 2 norms the MLP's input with pre_feedforward_layernorm
        h = resid_mid if post_norms_only else getattr(block, "pre_feedforward_layernorm",
                                                          block.post_attention_layernorm)(resid_mid)
        return block.mlp.act_fn(block.mlp.gate_proj(h)) * block.mlp.up_proj(h)
    proj = {"attn_q": attn.q_proj, "attn_k": attn.k_proj, "attn_v": attn.v_proj}[hook]
    return proj(x).view(x.shape[0], -1, head_dim)


def _neox_reference(full, hook: str, layer: int, resid_pre: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX with its parallel residual: q/k/v cut per head out of the fused projection; the
    MLP reads the layer's input (there is no mid-layer residual)."""
    block = full.gpt_neox.layers[layer]
    if hook == "mlp_post":
        return block.mlp.act(block.mlp.dense_h_to_4h(block.post_attention_layernorm(resid_pre)))
    head_dim = full.config.hidden_size // full.config.num_attention_heads
    part = {"attn_q": 0, "attn_k": 1, "attn_v": 2}[hook]
    qkv = block.attention.query_key_value(block.input_layernorm(resid_pre))
    return qkv.unflatten(-1, (-1, 3 * head_dim))[..., part * head_dim : (part + 1) * head_dim]


def test_sharded_hooks_merge_to_the_full_projection_and_each_shard_is_its_slice(tp_run):
    store, checked = tp_run["store"], 0
    for name, (_, _, _, hooks, _) in CASES.items():
        full = tp_run["full"][name]
        for rid in tp_run["ranks"][0][name]["request_ids"]:
            resid_pre = store.get_internal(name, rid, "resid_pre", run_id=RUN)
            resid_mid = store.get_internal(name, rid, "resid_mid", run_id=RUN) if "resid_mid" in hooks else None
            for hook in SHARDED:
                if hook == "mlp_post" and name == "mixtral":
                    continue  # Mixtral's experts are fused parameters: no mlp_post module to hook
                merged = store.get_internal(name, rid, hook, run_id=RUN)
                lazy = store.lazy(name, rid, hook, run_id=RUN)
                assert lazy.shape == merged.shape and torch.equal(lazy[-1], merged[-1])
                if hook != "attn_z":
                    with torch.no_grad():
                        want = torch.stack([_reference(full, hook, l, resid_pre[l], None if resid_mid is None else resid_mid[l])
                                            for l in range(merged.shape[0])])
                    torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)
                kv_heads = getattr(full.config, "num_key_value_heads", None) or full.config.num_attention_heads
                replicated = hook in ("attn_k", "attn_v") and kv_heads < WORLD or hook in WHOLE.get(name, ())
                for rank in range(WORLD):
                    if replicated and rank > 0:  # replicated k/v, a whole hook: written once, by rank 0
                        with pytest.raises(RecordNotFoundError):
                            store.get_internal(name, rid, hook, run_id=RUN, shard_rank=rank)
                        continue
                    shard = store.get_internal(name, rid, hook, run_id=RUN, shard_rank=rank)
                    assert store.lazy(name, rid, hook, run_id=RUN, shard_rank=rank).shape == shard.shape
                    width = merged.shape[2] if replicated else merged.shape[2] // WORLD
                    offset = 0 if replicated else rank * width
                    assert torch.equal(shard, merged.narrow(2, offset, width)), (name, hook, rank)
                    checked += 1
    assert checked > 50


def test_every_hook_matches_the_tp1_capture(tp_run):
    store = tp_run["store"]
    for name, (_, _, _, hooks, _) in CASES.items():
        pairs = zip(tp_run["ranks"][0][name]["request_ids"], tp_run["tp1"][name]["request_ids"])
        for rid2, rid1 in pairs:
            for hook in hooks:
                tp2 = store.get_internal(name, rid2, hook, run_id=RUN)
                tp1 = store.get_internal(name, rid1, hook, run_id="tp1")
                torch.testing.assert_close(tp2, tp1, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name} {hook}: {m}")


def test_contents_show_the_tp_layout(tp_run):
    store = tp_run["store"]
    rid = tp_run["ranks"][0]["llama-kv1"]["request_ids"][0]
    hooks = {h.hook: h for h in store.contents("llama-kv1", rid, run_id=RUN).hooks}
    assert (hooks["attn_q"].shard_ranks, hooks["attn_q"].tp_layout) == ((0, 1), "split on axis 1 over 2 ranks")
    # one kv head on two ranks: replicated, written once
    assert (hooks["attn_k"].shard_ranks, hooks["attn_k"].tp_layout) == ((0,), "replicated on 2 ranks, stored by rank(s) [0]")
    assert hooks["resid_post"].tp_layout == "replicated on 2 ranks, stored by rank(s) [0]"
    assert hooks["mlp_post"].feature_shape == (48,)  # the model's width, not a rank's


# --------------------------------------------------------------------------- a rank killed


def _capture_then_die(rank: int, world: int, home: str, path: str) -> dict:
    """Both ranks generate with capture; rank 1 is SIGKILLed when it publishes (after its
    pack is sealed): a stand-in for a power cut at exactly that point."""
    from dmi.capture import _session

    model, _ = _load_rank_model(path, "transformers", rank)
    if rank == 1:
        _session._Publishing.publish = lambda self, descriptors: os.kill(os.getpid(), signal.SIGKILL)
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store:
        with torch.no_grad(), store.capture(model, hooks=["resid_pre", "attn_q"], model_id="killed", run_id=RUN) as cap:
            rids, _ = cap.generate(ids, attention_mask=mask, **GEN)
            cap.flush()
    return dict(request_ids=list(rids))


def test_a_killed_rank_is_named_and_recovery_completes_it(tmp_path, capsys):
    import transformers

    path = str(tmp_path / "model")
    tiny("llama", num_key_value_heads=4).save_pretrained(path)
    home = str(tmp_path / "home")
    rank0, rank1 = run_ranks(_capture_then_die, WORLD, tmp_path / "ranks", home, path)
    assert rank1 == -signal.SIGKILL and isinstance(rank0, dict), (rank0, rank1)
    full = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with dmi.open(home=home) as store:
        rid = rank0["request_ids"][1]
        resid_pre = store.get_internal("killed", rid, "resid_pre", run_id=RUN)  # rank 0's, published
        with pytest.raises(MissingShardError, match=r"TP rank\(s\) \[1\] of 2 are missing \(present: \[0\]\)") as info:
            store.get_internal("killed", rid, "attn_q", run_id=RUN)
        assert (info.value.present, info.value.missing) == ((0,), (1,))
        hooks = {h.hook: h.tp_layout for h in store.contents("killed", rid, run_id=RUN).hooks}
        assert hooks["attn_q"] == "split on axis 1 over 2 ranks; rank(s) [1] missing"
        recovered = store.recover()
        assert len(recovered) == 1 and recovered[0].records > 0
        merged = store.get_internal("killed", rid, "attn_q", run_id=RUN)
        with torch.no_grad():
            want = torch.stack([_reference(full, "attn_q", l, resid_pre[l], None) for l in range(merged.shape[0])])
        torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)
    from dmi.cli import main

    assert main(["show", "killed", rid, "--run", RUN, "--home", home]) == 0
    shown = capsys.readouterr().out
    assert "tensor parallel" in shown and "split on axis 1 over 2 ranks" in shown and "missing" not in shown


def test_transformers_tp_refuses_kv_heads_it_would_pair_wrongly(tmp_path):
    """2 kv heads on 4 ranks: replicated, every rank would hold both kv heads and attention
    would pair its query heads with the wrong one, so it is refused before any weight loads; 1 kv head (replicated) and 2 on 2 ranks are fine."""
    from dmi.capture._tp_load import load_tensor_parallel, replicated_kv_plan
    from dmi.storage.errors import InvalidArgumentError

    tiny("llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=64).save_pretrained(tmp_path)
    with pytest.raises(InvalidArgumentError, match="2 key/value heads cannot be split over 4 ranks"):
        load_tensor_parallel(tmp_path, 4)

    class Config:
        num_attention_heads = 8
        num_key_value_heads = 2

    assert replicated_kv_plan(Config, 2) is None
    Config.num_key_value_heads = 1
    assert set(replicated_kv_plan(Config, 4).values()) == {"replicate"}
