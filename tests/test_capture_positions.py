"""Audit of what Hugging Face capture records: every record, position by position, against
plain forward hooks of the test's own (not DMI's module table), over architectures, dtypes,
batch sizes, decode steps and schedules; and the generation modes and layouts capture
cannot follow, refused by name rather than stored wrong."""

from __future__ import annotations

import pytest
import torch

from ._models import MemoryWriter, left_padded_batch, tiny
from dmi.capture import Schedule, attach
from dmi.storage.errors import InvalidArgumentError, UnsupportedGenerationError

N_NEW = 4


def _last(o):
    return o[0] if isinstance(o, tuple) else o


def _points(model, kind: str) -> dict:
    """``{(hook, layer): (module, "pre" | "post", pick)}``: where each hook is, written here
    independently of ``capture/_arch.py``; ``pick(args, output)`` gives ``[b, t, ...]`` (the
    router: ``[b * t, ...]``)."""
    if kind == "gpt2":
        base, width = model.transformer, model.config.n_embd
        points = {("embed", -1): (base.wte, "post", lambda a, o: o),
                  ("final_norm", -1): (base.ln_f, "post", lambda a, o: o)}
        for i, layer in enumerate(base.h):
            points.update({
                ("resid_pre", i): (layer, "pre", lambda a, o: a[0]),
                ("attn_q", i): (layer.attn.c_attn, "post", lambda a, o: o[..., :width]),
                ("attn_k", i): (layer.attn.c_attn, "post", lambda a, o: o[..., width:2 * width]),
                ("attn_v", i): (layer.attn.c_attn, "post", lambda a, o: o[..., 2 * width:]),
                ("attn_z", i): (layer.attn.c_proj, "pre", lambda a, o: a[0]),
                ("attn_out", i): (layer.attn, "post", lambda a, o: o[0]),
                ("resid_mid", i): (layer.ln_2, "pre", lambda a, o: a[0]),
                ("mlp_post", i): (layer.mlp.c_proj, "pre", lambda a, o: a[0]),
                ("mlp_out", i): (layer.mlp, "post", lambda a, o: o),
                ("resid_post", i): (layer, "post", lambda a, o: _last(o)),
            })
    elif kind == "gpt_neox":
        base, head_dim = model.gpt_neox, model.config.hidden_size // model.config.num_attention_heads
        points = {("embed", -1): (base.embed_in, "post", lambda a, o: o),
                  ("final_norm", -1): (base.final_layer_norm, "post", lambda a, o: o)}
        for i, layer in enumerate(base.layers):
            per_head = lambda o, part: o.view(*o.shape[:2], -1, 3 * head_dim)[..., part * head_dim:(part + 1) * head_dim]
            points.update({
                ("resid_pre", i): (layer, "pre", lambda a, o: a[0]),
                ("attn_q", i): (layer.attention.query_key_value, "post", lambda a, o: per_head(o, 0)),
                ("attn_k", i): (layer.attention.query_key_value, "post", lambda a, o: per_head(o, 1)),
                ("attn_v", i): (layer.attention.query_key_value, "post", lambda a, o: per_head(o, 2)),
                ("attn_z", i): (layer.attention.dense, "pre", lambda a, o: a[0]),
                ("attn_out", i): (layer.attention, "post", lambda a, o: o[0]),
                ("mlp_post", i): (layer.mlp.dense_4h_to_h, "pre", lambda a, o: a[0]),
                ("mlp_out", i): (layer.mlp, "post", lambda a, o: o),
                ("resid_post", i): (layer, "post", lambda a, o: _last(o)),
            })  # a parallel residual: no resid_mid
    else:
        base = model.model
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        sizes = [model.config.num_attention_heads * head_dim] + [model.config.num_key_value_heads * head_dim] * 2
        points = {("embed", -1): (base.embed_tokens, "post", lambda a, o: o),
                  ("final_norm", -1): (base.norm, "post", lambda a, o: o)}
        if kind == "granite":  # the model scales the embeddings before layer 0
            points[("embed", -1)] = (base.layers[0], "pre", lambda a, o: a[0])
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            points.update({
                ("resid_pre", i): (layer, "pre", lambda a, o: a[0]),
                **({("attn_q", i): (attn.q_proj, "post", lambda a, o: o),
                    ("attn_k", i): (attn.k_proj, "post", lambda a, o: o),
                    ("attn_v", i): (attn.v_proj, "post", lambda a, o: o)} if kind != "phi3" else
                   {(h, i): (attn.qkv_proj, "post", lambda a, o, part=part: o.split(sizes, dim=-1)[part])
                    for part, h in enumerate(("attn_q", "attn_k", "attn_v"))}),
                ("attn_z", i): (attn.o_proj, "pre", lambda a, o: a[0]),
                ("attn_out", i): (attn, "post", lambda a, o: o[0]),
                ("resid_mid", i): (layer.post_attention_layernorm, "pre", lambda a, o: a[0]),
                ("mlp_out", i): (layer.mlp, "post", lambda a, o: _last(o)),
                ("resid_post", i): (layer, "post", lambda a, o: _last(o)),
            })
            if kind == "granite":  # each block's output scaled before the residual add
                m = model.config.residual_multiplier
                points.update({
                    ("attn_out", i): (attn, "post", lambda a, o, m=m: o[0] * m),
                    ("mlp_out", i): (layer.mlp, "post", lambda a, o, m=m: o * m),
                })
            if kind in ("olmo2", "olmo3"):  # only post norms: the MLP's input is the mid-layer residual
                points.update({
                    ("attn_out", i): (layer.post_attention_layernorm, "post", lambda a, o: o),
                    ("resid_mid", i): (layer.mlp, "pre", lambda a, o: a[0]),
                    ("mlp_out", i): (layer.post_feedforward_layernorm, "post", lambda a, o: o),
                })
            if kind in ("gemma2", "gemma3_text"):  # each block's output is normed before the residual add
                points.update({
                    ("attn_out", i): (layer.post_attention_layernorm, "post", lambda a, o: o),
                    ("resid_mid", i): (layer.pre_feedforward_layernorm, "pre", lambda a, o: a[0]),
                    ("mlp_out", i): (layer.post_feedforward_layernorm, "post", lambda a, o: o),
                })
            if kind in ("mixtral", "gpt_oss"):
                router = layer.mlp.gate if kind == "mixtral" else layer.mlp.router
                points[("router_logits", i)] = (router, "post", lambda a, o: o[0])
                points[("router_topk", i)] = (router, "post", lambda a, o: o[2])
            else:
                points[("mlp_post", i)] = (layer.mlp.down_proj, "pre", lambda a, o: a[0])
    points[("logits", -1)] = (model, "post", lambda a, o: o.logits)  # as the model returns them (soft-capped)
    return points


class _Reference:
    """Every forward's tensors at every point, ``[b, t, ...]``, with the forward's input ids."""

    def __init__(self, model, kind: str):
        self.steps: list[dict] = []
        self.handles = [model.register_forward_pre_hook(self._start, with_kwargs=True)]
        for key, (module, when, pick) in _points(model, kind).items():
            if when == "pre":
                self.handles.append(module.register_forward_pre_hook(
                    lambda m, a, key=key, pick=pick: self._keep(key, pick(a, None))))
            else:
                self.handles.append(module.register_forward_hook(
                    lambda m, a, o, key=key, pick=pick: self._keep(key, pick(a, o))))

    def _start(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        self.steps.append({("token_ids", -1): (args[0] if ids is None else ids).clone()})

    def _keep(self, key, x):
        ids = self.steps[-1][("token_ids", -1)]
        self.steps[-1][key] = x.detach().reshape(*ids.shape[:1], -1, *x.shape[-1:]) if key[0].startswith("router") \
            else x.detach().clone()

    def remove(self):
        for h in self.handles:
            h.remove()


def _kept(schedule: Schedule, phase: str, pos: int, real: int) -> bool:
    """Whether ``schedule`` keeps the token at real position ``pos`` of a ``real``-token prompt."""
    if schedule.last_tokens is not None and phase != "decode" and pos < real - schedule.last_tokens:
        return False
    if schedule.positions is not None:
        lo, hi = schedule.positions
        return pos >= lo and (hi is None or pos < hi)
    return True


def _expected(ref: _Reference, schedule: Schedule, row: int, pad: int, real: int, phase0: str) -> dict:
    """``{(hook, layer): {position: (step, phase, values)}}`` one request should hold."""
    want: dict = {}
    for step, tensors in enumerate(ref.steps):
        phase = phase0 if step == 0 else "decode"
        if not schedule.admits_step(step, phase, step) or not schedule.admits_request(row):
            continue
        fed = tensors[("token_ids", -1)].shape[1]
        for key, x in tensors.items():
            x = x.unsqueeze(-1) if x.dim() == 2 else x
            for col in range(fed - x.shape[1], fed):  # logits: only the materialised tail
                pos = col - pad if step == 0 else real + step - 1
                if pos >= 0 and _kept(schedule, phase, pos, real):
                    want.setdefault(key, {})[pos] = (step, phase, x[row, col - (fed - x.shape[1])])
    return want


def _recorded(writer: MemoryWriter, rid: str) -> dict:
    """The same map from the records: decode records cover consecutive steps from ``step``."""
    got: dict = {}
    for k, data, _ in writer.records:
        if k.request_id != rid:
            continue
        assert data.shape[0] == k.n_tokens, k
        for j in range(k.n_tokens):
            per = got.setdefault((k.hook, k.layer), {})
            assert k.start_token + j not in per, f"{k.hook} {k.layer}: position {k.start_token + j} twice"
            per[k.start_token + j] = (k.step + j if k.phase == "decode" else k.step, k.phase, data[j])
    return got


def _audit(kind, dtype, lengths, *, hooks="all_but_patterns", schedule=None, chunk=2, scoring=False):
    model = tiny(kind, dtype=dtype) if kind == "gpt2" else tiny(kind, dtype=dtype, num_hidden_layers=2)
    ids, mask = left_padded_batch(lengths)
    pads = mask.eq(0).sum(1).tolist()
    writer, ref = MemoryWriter(), _Reference(model, kind)
    try:
        with attach(model, hooks=hooks, writer=writer, schedule=schedule, decode_chunk_steps=chunk) as cap:
            if scoring:
                rids, _ = cap.forward(ids, attention_mask=mask)
            else:
                rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                                      do_sample=False)
            selected = {(hook, layer) for hook, layers in cap.hooks.items() for layer in layers}
    finally:
        ref.remove()
    assert len(ref.steps) == (1 if scoring else N_NEW)
    schedule = Schedule.coerce(schedule)
    for row, rid in enumerate(rids):
        real = ids.shape[1] - pads[row]
        want = _expected(ref, schedule, row, pads[row], real, "forward" if scoring else "prefill")
        got = _recorded(writer, rid)
        want = {key: per for key, per in want.items() if key in selected}
        assert sorted(got) == sorted(want), (rid, sorted(set(got) ^ set(want)))
        for key, per in want.items():
            assert sorted(got[key]) == sorted(per), (rid, key)
            for pos, (step, phase, values) in per.items():
                g_step, g_phase, g_values = got[key][pos]
                assert (g_step, g_phase) == (step, phase), (rid, key, pos)
                assert g_values.dtype == values.dtype and torch.equal(g_values, values.reshape(g_values.shape)), \
                    (rid, key, pos)
    return writer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gpt_neox",
                                  "phi3", "gpt2", "mixtral", "olmo2", "olmo3", "gpt_oss", "smollm3", "granite"])
def test_every_hook_equals_plain_hooks_at_every_position(kind, dtype):
    """Left-padded batch of unequal prompts and a batch of one, prefill and 4 decode steps
    coalesced by twos: each record's tokens, positions, steps and phase, bit for bit."""
    _audit(kind, dtype, (7, 3, 5))
    _audit(kind, dtype, (5,))


SCHEDULES = [
    Schedule(last_tokens=2), Schedule(last_tokens=10), Schedule(positions=(2, 6)), Schedule(positions=(5, None)),
    Schedule(positions=(8, 9)), Schedule(last_tokens=3, positions=(1, 7)), Schedule(phases="decode"),
    Schedule(phases="prefill", last_tokens=2), Schedule(step_stride=2, positions=(3, 9)),
    Schedule(request_stride=2), Schedule(warmup=2, step_stride=2),
]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_schedules_keep_exactly_their_tokens(schedule, chunk):
    _audit("llama", torch.float32, (7, 3, 5), hooks="resid_post attn_k logits token_ids",
           schedule=schedule, chunk=chunk)


@pytest.mark.parametrize("schedule", [None, Schedule(last_tokens=2), Schedule(positions=(1, 4))], ids=repr)
def test_scoring_forward_keeps_every_position(schedule):
    _audit("mixtral", torch.bfloat16, (7, 3, 5), schedule=schedule, scoring=True)


# ------------------------------------------------------------------- refused, by name


@pytest.mark.parametrize("phases", [("prefill", "prefill"), ["decode", "prefill", "decode"]])
def test_a_phase_listed_twice_is_refused_like_the_cli_refuses_it(phases):
    repeated = "'prefill'" if phases[0] == "prefill" else "'decode'"
    with pytest.raises(InvalidArgumentError) as info:
        Schedule(phases=phases)
    assert str(info.value) == f"schedule phases {tuple(phases)!r} lists {repeated} more than once; name each phase once"
    with pytest.raises(InvalidArgumentError, match="more than once"):
        Schedule.coerce({"phases": list(phases)})
    with pytest.raises(InvalidArgumentError, match="more than once"):
        Schedule.coerce(list(phases))
    assert Schedule(phases=("decode", "prefill")).phases == ("decode", "prefill")


def _nothing_recorded_when(generate_kwargs: dict, direct: bool) -> str:
    """Run a refused ``generate`` (the session's, or ``model.generate`` inside the block) and
    return the error's message, checking the model never ran."""
    model = tiny("llama", num_hidden_layers=1)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    writer, forwards = MemoryWriter(), []
    handle = model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        with attach(model, hooks="resid_post token_ids", writer=writer) as cap, \
                pytest.raises(UnsupportedGenerationError) as err:
            if direct:
                model.generate(ids, max_new_tokens=3, do_sample=False, **generate_kwargs)
            else:
                cap.generate(ids, max_new_tokens=3, do_sample=False, **generate_kwargs)
    finally:
        handle.remove()
    assert forwards == [] and writer.records == []
    return str(err.value)


@pytest.mark.parametrize("direct", [False, True], ids=["session", "model.generate"])
def test_generate_without_cache_is_refused(direct):
    """It re-feeds the whole sequence every step: stored as new tokens at wrong positions."""
    assert "use_cache=False" in _nothing_recorded_when(dict(use_cache=False), direct)


@pytest.mark.parametrize("direct", [False, True], ids=["session", "model.generate"])
def test_assisted_generation_is_refused(direct):
    """Prompt lookup feeds guessed tokens: the rejected ones were stored as the sequence's."""
    message = _nothing_recorded_when(dict(prompt_lookup_num_tokens=3), direct)
    assert "assisted generation (prompt_lookup_num_tokens)" in message


def test_generate_from_a_filled_cache_is_refused_and_a_fresh_one_is_not():
    from transformers import DynamicCache

    model = tiny("llama", num_hidden_layers=1)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cache = model(ids[:, :4], use_cache=True).past_key_values
    writer = MemoryWriter()
    with attach(model, hooks="token_ids", writer=writer, decode_chunk_steps=1) as cap:
        with pytest.raises(UnsupportedGenerationError, match="already holds 4 token"):
            cap.generate(ids, max_new_tokens=2, do_sample=False, cache=cache)
        assert writer.records == []
        cap.generate(ids, max_new_tokens=2, do_sample=False, cache=DynamicCache(config=model.config))
    assert [(k.phase, k.start_token, d.tolist()) for k, d, _ in writer.records][0] == \
        ("prefill", 0, ids[0].tolist())


def test_transformers_tp_refuses_kv_heads_the_ranks_do_not_divide(tmp_path):
    """3 kv heads on 2 ranks: transformers cuts k/v mid-head and attention fails with a bare
    shape error; refused by name before any weight loads. 4 on 2 still loads its own plan."""
    from dmi.capture._tp_load import load_tensor_parallel, replicated_kv_plan

    tiny("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
         num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(InvalidArgumentError, match="3 key/value heads cannot be split evenly over 2 ranks"):
        load_tensor_parallel(tmp_path, 2)

    class Config:
        num_attention_heads = 8
        num_key_value_heads = 4

    assert replicated_kv_plan(Config, 2) is None
    assert replicated_kv_plan(Config, 4) is None


# ------------------------------------------------------------- tensor parallel, uneven cut

TP_HOOKS = ["attn_q", "attn_k", "attn_v", "attn_z", "mlp_post", "resid_post", "logits"]


def _tp_rank_capture(rank: int, world: int, path: str, home: str) -> list[str]:
    """On one spawned rank: transformers' own TP of the model at ``path``, captured into ``home``."""
    import dmi
    from dmi.capture import load_tensor_parallel

    model = load_tensor_parallel(path, world, dtype=torch.float32).eval()
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store, torch.no_grad(), \
            store.capture(model, hooks=TP_HOOKS, model_id="uneven", run_id="tp2") as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                               pad_token_id=0)
    return list(rids)


def test_tp_shards_of_an_uneven_intermediate_read_back_as_the_unsharded_model(tmp_path):
    """Intermediate 49 on 2 ranks is cut 25 + 24 (ceil blocks, as DTensor cuts it): each
    rank's mlp_post records say so, and every merged read equals the unsharded capture."""
    import dmi

    from ._tp_harness import RankFailed, run_ranks

    model = tiny("llama", num_hidden_layers=2, num_key_value_heads=2, intermediate_size=49)
    model.save_pretrained(tmp_path / "model")
    home = str(tmp_path / "home")
    results = run_ranks(_tp_rank_capture, 2, tmp_path / "ranks", str(tmp_path / "model"), home)
    assert not any(isinstance(r, (RankFailed, int)) for r in results), results
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store:
        with torch.no_grad(), store.capture(model, hooks=TP_HOOKS, model_id="uneven", run_id="tp1") as cap:
            tp1, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        for rid2, rid1 in zip(results[0], tp1):
            for hook in TP_HOOKS:
                merged = store.get_internal("uneven", rid2, hook, run_id="tp2")
                want = store.get_internal("uneven", rid1, hook, run_id="tp1")
                assert merged.shape == want.shape, hook
                torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)
            widths = [store.get_internal("uneven", rid2, "mlp_post", run_id="tp2", shard_rank=r).shape[-1]
                      for r in range(2)]
            assert widths == [25, 24]
