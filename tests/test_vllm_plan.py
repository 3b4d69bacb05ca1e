"""The vLLM step planner on batches as vLLM's model runner lays them out (no vLLM needed): which
rows of the flattened token axis go to which request, at which positions and phase."""

from __future__ import annotations

import torch

from dmi.capture import ModelGeometry, Schedule
from dmi.capture._vllm_plan import BatchView, VLLMPlanner, external_request_id

GEOMETRY = ModelGeometry("llama", 3, 128, 2, 1, 64, 256, 259, torch.float32)


def _planner(hooks=("resid_post", "logits"), schedule=None) -> VLLMPlanner:
    selected = {h: ((-1,) if h == "logits" else (0, 1, 2)) for h in hooks}
    return VLLMPlanner(GEOMETRY, selected, Schedule.coerce(schedule))


def _spans(plan):
    return [(s.request_id, s.first_col, s.n, s.start, s.offset) for s in plan.spans]


def test_a_mixed_forward_splits_into_prompt_and_decode_plans_with_real_positions():
    # request a decodes its token at position 12; b runs prompt tokens 52..114 (a chunk);
    # c starts its 2-token prompt — the layout of a vLLM step with chunked prefill
    batch = BatchView(("a-0123abcd", "b-89abcdef", "c-00000000"), (0, 1, 64, 66), (12, 52, 0), (12, 136, 2), 66)
    step = _planner().plan(batch)
    prefill, decode = step.token_plans
    assert (prefill.phase, decode.phase) == ("prefill", "decode")
    assert _spans(prefill) == [("b", 1, 63, 52, 0), ("c", 64, 2, 0, 63)]
    assert prefill.index.tolist() == list(range(1, 66))
    assert _spans(decode) == [("a", 0, 1, 12, 0)]
    assert decode.index.tolist() == [0]
    # logits: one row per request; b's chunk ends inside its prompt, so vLLM never samples it
    logits = {p.phase: [(s.request_id, s.first_col, s.start) for s in p.spans] for p in step.logits_plans}
    assert logits == {"prefill": [("c", 2, 1)], "decode": [("a", 0, 12)]}


def test_a_forward_of_one_phase_in_order_copies_without_an_index():
    batch = BatchView(("a-0123abcd", "b-89abcdef"), (0, 1, 2), (5, 9), (3, 4), 2)
    step = _planner().plan(batch)
    (decode,) = step.token_plans
    assert decode.index is None and step.logits_plans[0].index is None


def test_padding_rows_after_the_last_request_are_not_captured():
    batch = BatchView(("a-0123abcd",), (0, 3), (0,), (3,), 8)  # the runner padded 3 tokens to 8 rows
    (plan,) = _planner().plan(batch).token_plans
    assert plan.index.tolist() == [0, 1, 2]


def test_a_recomputed_request_is_trimmed_to_what_was_not_captured():
    planner = _planner()
    planner.plan(BatchView(("a-0123abcd",), (0, 10), (0,), (10,), 10))
    for position in range(10, 14):  # four decode steps: positions 10..13 captured
        planner.plan(BatchView(("a-0123abcd",), (0, 1), (position,), (10,), 1))
    # preempted, then recomputed from position 0 with its new token at 14
    step = planner.plan(BatchView(("a-0123abcd",), (0, 15), (0,), (10,), 15))
    (plan,) = step.token_plans
    assert _spans(plan) == [("a", 14, 1, 14, 0)] and plan.phase == "decode"
    assert planner.recomputed_tokens == 14
    # recomputation of only already-captured tokens (a partial chunk) captures nothing
    planner.forget(["a-0123abcd"])
    planner.plan(BatchView(("b-0123abcd",), (0, 8), (0,), (8,), 8))
    assert planner.plan(BatchView(("b-0123abcd",), (0, 4), (0,), (8,), 4)) is None


def test_schedule_phases_strides_and_last_tokens_apply_per_request():
    decode_only = _planner(schedule={"phases": ("decode",)})
    batch = BatchView(("a-0123abcd", "b-89abcdef"), (0, 1, 6), (7, 0), (7, 5), 6)
    (plan,) = decode_only.plan(batch).token_plans
    assert _spans(plan) == [("a", 0, 1, 7, 0)]

    last = _planner(schedule={"last_tokens": 2})
    (plan,) = last.plan(BatchView(("a-0123abcd",), (0, 5), (0,), (5,), 5)).token_plans
    assert _spans(plan) == [("a", 3, 2, 3, 0)]

    every_other = _planner(schedule={"request_stride": 2})
    ids = tuple(f"r{i}-0123abcd" for i in range(4))
    step = every_other.plan(BatchView(ids, (0, 1, 2, 3, 4), (0, 0, 0, 0), (1, 1, 1, 1), 4))
    assert step.request_ids == ("r0", "r2")


def test_external_request_id_strips_only_vllms_suffix():
    assert external_request_id("0-8cd3300a") == "0"
    assert external_request_id("cmpl-abc-12345678") == "cmpl-abc"
    assert external_request_id("plain") == "plain"
    assert external_request_id("x-123") == "x-123"


def test_a_position_window_cuts_chunks_and_keeps_logits_only_for_a_kept_last_token():
    planner = _planner(schedule={"positions": (4, 10)})
    # a prompt of 12 in chunks 0..7 and 8..11, then decode at 12: only positions 4..9 kept
    first = planner.plan(BatchView(("a-0123abcd",), (0, 8), (0,), (12,), 8))
    (plan,) = first.token_plans
    assert _spans(plan) == [("a", 4, 4, 4, 0)] and first.logits_plans == ()
    second = planner.plan(BatchView(("a-0123abcd",), (0, 4), (8,), (12,), 4))
    (plan,) = second.token_plans
    assert _spans(plan) == [("a", 0, 2, 8, 0)]
    assert second.logits_plans == ()  # the step's last token (11) is outside the window
    assert planner.plan(BatchView(("a-0123abcd",), (0, 1), (12,), (12,), 1)) is None
    # a short prompt whose last token and first decode token fall inside the window
    planner.plan(BatchView(("b-0123abcd",), (0, 6), (0,), (6,), 6))
    step = planner.plan(BatchView(("b-0123abcd",), (0, 1), (6,), (6,), 1))
    assert [(s.request_id, s.start) for p in step.logits_plans for s in p.spans] == [("b", 6)]


def test_a_reused_request_id_is_stored_under_the_engine_id_not_merged():
    """vLLM accepts one external id twice (a client retrying with the same X-Request-Id) and
    only appends its random suffix: the second request is stored under its full engine id and
    counted, so that no two requests share one DMI id — also after the first has finished."""
    planner = _planner(hooks=("resid_post",))
    step = planner.plan(BatchView(("dup-0123abcd", "dup-89abcdef"), (0, 2, 5), (0, 0), (2, 3), 5))
    assert [s.request_id for s in step.token_plans[0].spans] == ["dup", "dup-89abcdef"]
    planner.forget(["dup-0123abcd", "dup-89abcdef"])
    step = planner.plan(BatchView(("dup-00000000",), (0, 4), (0,), (4,), 4))
    assert [s.request_id for s in step.token_plans[0].spans] == ["dup-00000000"]
    assert planner.duplicate_request_ids == 2
    step = planner.plan(BatchView(("other-11111111",), (0, 1), (0,), (1,), 1))
    assert [s.request_id for s in step.token_plans[0].spans] == ["other"] and planner.duplicate_request_ids == 2
