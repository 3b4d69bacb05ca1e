"""A DMI error raised in a vLLM worker process reaches the caller with everything it has in one
process: its class, message and arguments, and its attributes with their types — a
``PlanError``'s ``source``/``field``/``reason``, a ``PackSealError``'s ``lost_keys`` (``RecordKey``
objects), a ``DrainError``'s ``settled``, a ``ServerError``'s ``code``/``name``, its notes — along
its cause chain (``dmi._worker_errors.error_reply`` and ``raise_replied``, which ``dmi.vllm``'s
worker calls answer with and its caller raises from). Every reply is sent through JSON here,
stricter than vLLM's channels (pickle; msgpack, which turns tuples and dataclasses into lists and
dicts as JSON does). Needs no vLLM: the reply is made and read without an engine.
"""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from dmi.capture import attach
from dmi._worker_errors import error_reply, raise_replied
from dmi.catalog import open_catalog
from dmi.storage import PackStore, errors
from dmi.storage.errors import DMIError, DrainError, PackSealError
from dmi.storage.records import RecordKey
from tests._models import left_padded_batch, tiny

KEY = RecordKey("m", "run", "req-1", "resid_post", 2, 0, 7, step=3, shard_rank=1, tp_size=2)


def _quorum():
    error = errors.QuorumError("write not confirmed by every replica")
    error.outcome_unknown, error.code = True, 286  # as catalog/_cluster.py sets them
    return error


def _settled_drain():
    error = errors.DrainError("the capture drain thread failed: OSError('disk')")
    error.settled = True  # as capture/_drain.py sets it
    error.add_note("a note the worker added")
    return error


MADE = {  # the classes a message alone does not make as they are raised: made here as DMI makes them
    "PlanError": lambda: errors.PlanError("plan.yaml", "hooks[2]", "hook 'nope' does not exist"),
    "PackSealError": lambda: errors.PackSealError("pack p: could not finish the file", lost_keys=[KEY]),
    "ServerError": lambda: errors.ServerError("Syntax error", code=62, name="SYNTAX_ERROR"),
    "MissingShardError": lambda: errors.MissingShardError("rank 1 missing", present=(0, 2), missing=(1,)),
    "QuorumError": _quorum,
    "DrainError": _settled_drain,
    "ExportError": lambda: errors.ExportError(28, "No space left on device", "/out/x.npy"),
}


def _crossed(exc: DMIError, *, attaching: bool = False) -> DMIError:
    """``exc`` as the caller of a worker that raised it raises it (the reply sent through JSON)."""
    reply = json.loads(json.dumps(error_reply(exc)))
    with pytest.raises(DMIError) as raised:
        raise_replied([reply], attaching=attaching)
    return raised.value


def _facts(exc: BaseException) -> tuple:
    """What a caller can see of ``exc``, as text that tells types apart (a tuple from a list, a
    ``RecordKey`` from a dict, ``True`` from ``1``)."""
    os_facts = (exc.errno, exc.strerror, exc.filename) if isinstance(exc, OSError) else None
    return type(exc), str(exc), repr(exc.args), repr(vars(exc)), os_facts


@pytest.mark.parametrize("name", errors.__all__)
@pytest.mark.parametrize("attaching", [False, True])
def test_every_dmi_error_crosses_with_its_class_message_and_attributes(name, attaching):
    exc = MADE.get(name, lambda: getattr(errors, name)(f"{name}: what happened; what to do"))()
    assert _facts(_crossed(exc, attaching=attaching)) == _facts(exc)


@pytest.mark.parametrize("name", errors.__all__)
def test_every_dmi_error_pickles_with_its_class_message_and_attributes(name):
    """Pickling (a DataLoader worker's error, vLLM's message queue) keeps everything too:
    ``PlanError`` is made again from its fields, not from its message."""
    exc = MADE.get(name, lambda: getattr(errors, name)(f"{name}: what happened; what to do"))()
    assert _facts(pickle.loads(pickle.dumps(exc))) == _facts(exc)


def test_the_fields_callers_use_arrive_equal_and_typed():
    plan = _crossed(MADE["PlanError"](), attaching=True)
    assert (type(plan), plan.source, plan.field, plan.reason) == (
        errors.PlanError, "plan.yaml", "hooks[2]", "hook 'nope' does not exist")
    sealed = _crossed(MADE["PackSealError"]())
    assert sealed.lost_keys == (KEY,) and type(sealed.lost_keys[0]) is RecordKey
    shards = _crossed(MADE["MissingShardError"]())
    assert (shards.present, shards.missing) == ((0, 2), (1,))
    drain = _crossed(_settled_drain())
    assert drain.settled is True and drain.__notes__ == ["a note the worker added"]


def test_an_attribute_with_no_plain_form_stays_behind_named_in_a_note():
    exc = errors.DrainError("stopped")
    exc.outputs, exc.settled = [object()], False
    crossed = _crossed(exc)
    assert vars(crossed) == {"settled": False, "__notes__": [
        "its attribute(s) outputs stayed in the vLLM worker's process (values that cannot cross it as plain data)"]}


def _a_real_drain_failure(tmp_path) -> DrainError:
    """What a capture in one process raises when its pack directory is replaced by a file
    mid-capture (a real write failure): ``DrainError`` from ``PackSealError`` with its ``lost_keys``."""
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(DrainError) as raised:
            with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m") as cap:
                cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
                shutil.move(tmp_path / "packs", tmp_path / "packs.moved")
                (tmp_path / "packs").write_text("")
                cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
                cap.flush()
    return raised.value


def _dmi_links(exc: BaseException) -> list:
    """``exc`` and its ``__cause__`` chain, down to its first link that is no DMI error."""
    chain = []
    while isinstance(exc, DMIError):
        chain.append(exc)
        exc = exc.__cause__
    return chain


def test_a_real_drain_failure_crosses_as_one_process_raises_it(tmp_path):
    """The chain a worker's drain failure raises — ``DrainError`` from ``PackSealError`` — arrives
    link by link as it is in one process: the ``settled`` flag, the ``RecordKey`` objects lost."""
    exc = _a_real_drain_failure(tmp_path)
    sealed = exc.__cause__
    assert type(sealed) is PackSealError and sealed.lost_keys and type(sealed.lost_keys[0]) is RecordKey
    assert [type(link).__name__ for link in _dmi_links(exc)] == ["DrainError", "PackSealError"]
    crossed = _crossed(exc)
    assert list(map(_facts, _dmi_links(crossed))) == list(map(_facts, _dmi_links(exc)))
    assert crossed.__cause__.lost_keys == sealed.lost_keys


def test_a_reply_naming_a_class_that_needs_fields_without_its_state_is_an_attach_error_naming_it():
    """A reply with a class name and message alone (no ``args``/``attrs``) cannot make a
    ``PlanError`` with its fields: it is not made half, but named in an ``AttachError``."""
    with pytest.raises(errors.AttachError) as raised:
        raise_replied([{"error": "PlanError", "message": "bad"}], attaching=True)
    assert (type(raised.value), str(raised.value)) == (errors.AttachError,
                                                       "a vLLM worker refused to attach (PlanError): bad")


def test_a_reply_naming_a_dataclass_outside_dmi_is_refused():
    """Only DMI's own dataclasses are made from a reply: a dataclass elsewhere (``pstats``'s) is not
    imported nor made."""
    link = {"error": "PackSealError", "message": "m", "args": ["m"],
            "attrs": {"lost_keys": {"tuple": [{"dataclass": ["pstats:FunctionProfile", {}]}]}}}
    with pytest.raises(errors.CaptureError) as raised:
        raise_replied([link])
    assert str(raised.value) == "a vLLM worker's error reply names 'pstats:FunctionProfile', which is no DMI dataclass"
