"""Bad arguments to attach, Schedule and a session's calls are refused with
``InvalidArgumentError`` naming the argument and what it takes — never a raw ``TypeError``,
``ValueError`` or ``AttributeError`` from deep inside, and never a batch the model runs."""

from __future__ import annotations

import pytest
import torch

from dmi.capture import Schedule, attach
from dmi.capture._ring import Ring
from dmi.storage.errors import InvalidArgumentError

from ._models import MemoryWriter, tiny


def _attach(**options):
    with attach(tiny("llama"), hooks="resid_post", writer=MemoryWriter(), **options):
        pass


@pytest.mark.parametrize("make, message", [
    (lambda: _attach(schedule={"steps": 2}), r"schedule has no field\(s\) 'steps'; its fields: phases, step_stride"),
    (lambda: Schedule.coerce({"stride": 2, "warmup": 1}), r"schedule has no field\(s\) 'stride'"),
    (lambda: Schedule(phases=None), r"schedule phases must be a phase name or several of \('prefill'"),
    (lambda: Schedule(phases=5), r"schedule phases must be a phase name or several of"),
    (lambda: _attach(ring_timeout="5"), r"ring_timeout must be a number of seconds >= 0, got '5'"),
    (lambda: _attach(ring_timeout=float("nan")), r"ring_timeout must be a number of seconds >= 0, got nan"),
    (lambda: Ring(1, 64, timeout=None), r"ring_timeout must be a number of seconds >= 0, got None"),
    (lambda: _attach(writer_options=5), r"writer_options must be a dict of PackWriter arguments, got 5"),
    (lambda: _attach(writer_options={"bogus": 1, "on_seal": print}),
     r"writer_options \['bogus', 'on_seal'\] are not PackWriter arguments a capture sets; choose from writer_id"),
], ids=["attach-schedule-field", "schedule-field", "phases-None", "phases-int", "ring_timeout-str",
        "ring_timeout-nan", "ring-timeout-None", "writer_options-int", "writer_options-unknown"])
def test_bad_attach_and_schedule_arguments_are_named(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()


@pytest.mark.parametrize("input_ids, attention_mask, message", [
    (torch.tensor([[5, 6]]), [[1, 1]], r"attention_mask must be a tensor of input_ids' shape .*got list"),
    (torch.ones(1, 2, 3, dtype=torch.long), None, r"input_ids must be a \[batch, tokens\] tensor .*shape \(1, 2, 3\)"),
    (torch.tensor([[5.0, 6.0]]), None, r"input_ids must hold integer token ids, got dtype torch.float32"),
    (torch.ones(0, 3, dtype=torch.long), None, r"input_ids needs at least one row and one token, got shape \(0, 3\)"),
    (torch.ones(2, 0, dtype=torch.long), None, r"input_ids needs at least one row and one token, got shape \(2, 0\)"),
    (["hello"], None, r"a list of prompts, each a list of token ids \(ints\), got \['hello'\]"),
    ([5, 6, 7], None, r"a list of prompts, each a list of token ids \(ints\), got \[5, 6, 7\]"),
    (7, None, r"a list of prompts, each a list of token ids \(ints\), got 7"),
    ([], None, r"every prompt needs at least one token"),
], ids=["mask-list", "ids-3d", "ids-float", "batch-0", "tokens-0", "prompt-str", "flat-list", "int", "empty"])
def test_bad_batches_are_refused_before_the_model_runs(input_ids, attention_mask, message):
    model = tiny("llama")
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with attach(model, hooks="resid_post", writer=MemoryWriter()) as cap:
        for call in (cap.forward, cap.generate):
            with pytest.raises(InvalidArgumentError, match=message):
                call(input_ids, attention_mask)
        assert cap.stats["requests"] == 0
    assert forwards == []
