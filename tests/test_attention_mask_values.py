"""An ``attention_mask`` holding anything but 0 and 1 is refused before the model runs.

Transformers reads a mask two ways: attention as ``mask.bool()`` (0.5 and 2 are real
tokens) and ``generate``'s position ids from ``mask.long().cumsum()`` (0.5 is padding). DMI
counted padding from ``mask.long()``, so a 0.5 silently dropped a token the model attended
to from the records. Exact 0.0/1.0 floats and bools mean what int 0/1 mean, and are taken.
"""

from __future__ import annotations

import pytest
import torch

from dmi.capture import attach, prepare_batch
from dmi.storage.errors import InvalidArgumentError

from ._models import MemoryWriter, tiny

IDS = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def _with(row0: list) -> torch.Tensor:
    return torch.stack([torch.tensor(row0), torch.ones(5, dtype=torch.tensor(row0).dtype)])


@pytest.mark.parametrize("mask, shown", [
    (_with([0, 0.5, 1, 1, 1]), "1 other value(s): 0.5"),
    (_with([0, 0, 0.5, 1, 1]), "1 other value(s): 0.5"),
    (_with([0, 0, 2, 2, 2]), "3 other value(s): 2"),
    (_with([0, 0, -1, 1, 1]), "1 other value(s): -1"),
    (_with([0, 0, float("nan"), 1, 1]), "1 other value(s): nan"),
], ids=["half-in-padding", "half-in-prompt", "two", "minus-one", "nan"])
def test_a_mask_value_other_than_0_and_1_is_refused_before_the_model_runs(mask, shown):
    model = tiny("llama")
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    writer = MemoryWriter()
    with attach(model, hooks="resid_post", layers=[0], writer=writer) as cap:
        for call in (cap.forward, cap.generate):
            with pytest.raises(InvalidArgumentError) as info:
                call(IDS, mask)
            message = str(info.value)
            assert message.startswith(f"attention_mask must hold only 0 (padding) and 1 (real token), got {shown};")
        assert cap.stats["requests"] == 0
    assert forwards == [] and writer.records == []


def test_a_complex_mask_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"attention_mask must hold 0 \(padding\) and 1 .*complex64"):
        prepare_batch(IDS, MASK.to(torch.complex64))


def test_a_bad_mask_given_to_the_model_directly_is_refused_too():
    """A forward DMI did not start (``model(...)`` inside ``attach``) reads its padding from
    the mask the model got: the same rule applies there, and nothing is recorded."""
    model = tiny("llama")
    writer = MemoryWriter()
    with attach(model, hooks="resid_post", layers=[0], writer=writer):
        with pytest.raises(InvalidArgumentError, match=r"got 1 other value\(s\): 0.5;"):
            model(IDS, attention_mask=_with([0, 0, 0.5, 1, 1]))
    assert writer.records == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int32])
def test_exact_0_and_1_of_any_real_dtype_capture_what_the_int64_mask_captures(dtype):
    ids, mask = prepare_batch(IDS, MASK.to(dtype))
    assert mask.dtype == torch.int64 and torch.equal(mask, MASK) and ids is IDS
    captured = {}
    for name, given in (("int64", MASK), ("other", MASK.to(dtype))):
        writer = MemoryWriter()
        with attach(tiny("llama"), hooks="resid_post", layers=[0], writer=writer, run_id="mask") as cap:
            cap.generate(IDS, given, max_new_tokens=2, do_sample=False)
        captured[name] = [(key, data) for key, data, _ in writer.records]
    keys = [(k.request_id, k.phase, k.start_token, k.n_tokens) for k, _ in captured["other"]]
    assert sorted(keys) == [("mask-000000", "decode", 3, 1), ("mask-000000", "prefill", 0, 3),
                            ("mask-000001", "decode", 5, 1), ("mask-000001", "prefill", 0, 5)]
    assert [k for k, _ in captured["other"]] == [k for k, _ in captured["int64"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(captured["other"], captured["int64"]))
