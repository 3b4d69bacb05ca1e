"""A hook, group or phase listed twice is refused, naming it: most likely a typo for another
name (``[resid_post, resid_post]`` meant ``resid_pre`` too), which capture used to dedupe
silently while the plan kept (and wrote back) both. A hook that is also a member of a
listed group is not a repeat: groups and names add up."""

from __future__ import annotations

import pytest
import torch

from dmi._plan_file import dump_plan, parse_plan
from dmi.capture import attach, resolve_hooks
from dmi.storage.errors import HookSelectionError, PlanError

from ._models import MemoryWriter, tiny


@pytest.mark.parametrize("body, field, reason", [
    ("hooks: [resid_post, logits, resid_post]", "hooks[2]",
     "hook or group 'resid_post' is listed twice (first at hooks[0]); list each once"),
    ("hooks: [attn, attn]", "hooks[1]", "hook or group 'attn' is listed twice (first at hooks[0]); list each once"),
    ("hooks: resid_post, resid_post", "hooks", "hook or group 'resid_post' is listed twice; list each once"),
    ("schedule: {phases: [prefill, decode, prefill]}", "schedule.phases[2]",
     "phase 'prefill' is listed twice (first at schedule.phases[0]); list each once"),
], ids=["hook", "group", "hook-string", "phase"])
def test_a_plan_listing_a_name_twice_is_refused_at_the_repeat(body, field, reason):
    with pytest.raises(PlanError) as info:
        parse_plan(f"version: 1\n{body}\n", source="plan.yaml")
    assert (info.value.source, info.value.field, info.value.reason) == ("plan.yaml", field, reason)


def test_a_plan_may_name_a_group_and_one_of_its_members():
    plan = parse_plan("version: 1\nhooks: [resid, resid_post]\nschedule: {phases: [prefill, decode]}\n")
    assert plan.hooks == ("resid", "resid_post") and plan.schedule.phases == ("prefill", "decode")
    assert parse_plan(dump_plan(plan)) == plan


@pytest.mark.parametrize("hooks, repeated", [
    (["resid_post", "resid_post"], "'resid_post'"),
    ("resid_post logits, resid_post", "'resid_post'"),
    (["mlp", "logits", "mlp", "logits"], "'logits', 'mlp'"),
    ("blocks.0.hook_resid_post blocks.0.hook_resid_post", "'blocks.0.hook_resid_post'"),
], ids=["list", "string", "two-groups", "alias"])
def test_attach_refuses_a_hook_listed_twice_before_the_model_is_touched(hooks, repeated):
    model = tiny("llama")
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(HookSelectionError) as info:
        with attach(model, hooks=hooks, writer=MemoryWriter()):
            model(torch.tensor([[5, 6, 7]]))
    assert str(info.value) == f"hooks {hooks!r} lists {repeated} more than once; name each hook or group once"
    with pytest.raises(HookSelectionError, match="more than once"):
        resolve_hooks(hooks)
    assert forwards == []


def test_a_group_and_its_member_capture_each_record_once():
    assert resolve_hooks("resid resid_post") == resolve_hooks("resid")
    writer = MemoryWriter()
    with attach(tiny("llama"), hooks=["resid", "resid_post"], layers=[0], writer=writer, run_id="dup") as cap:
        cap.forward(torch.tensor([[5, 6, 7]]))
    keys = sorted((k.hook, k.layer) for k, _, _ in writer.records)
    assert keys == [("embed", -1), ("final_norm", -1), ("resid_mid", 0), ("resid_post", 0), ("resid_pre", 0)]
