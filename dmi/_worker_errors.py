"""A DMI error raised in a vLLM worker process, carried to the caller's process as plain data.

vLLM's channels to its workers pickle (the message queue) or speak msgpack (the engine
process's), which carries lists, dicts, strings and numbers but turns tuples and dataclasses
into lists and dicts — and a raised exception reaches the caller only as vLLM's generic
worker error, its class and facts lost. So a worker answers with :func:`error_reply` and the
caller raises :func:`raise_replied`: the same class, message, arguments and attributes
(``PackSealError.lost_keys`` as ``RecordKey`` objects, ``DrainError.settled``, ``PlanError``'s
fields, notes), along its cause chain. Needs no vLLM (``dmi.vllm`` does), so it is tested
without an engine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from dmi.storage import errors
from dmi.storage.errors import AttachError, CaptureError, DMIError

__all__ = ["error_reply", "raise_replied"]

_CAUSES_KEPT = 8
"""How many links of a worker error's ``__cause__`` chain are sent back with it."""


def error_reply(exc: DMIError) -> dict:
    """``exc`` as plain data that crosses vLLM's process boundary unchanged — its message queue
    pickles, its engine process's channel is msgpack, which carries lists, dicts, strings and
    numbers but turns tuples and dataclasses into lists and dicts: ``{"error": class name,
    "message": ..., "args": ..., "attrs": ..., "causes": [...]}``, its ``__cause__`` chain
    outermost first, each link so (:func:`_link`). :func:`raise_replied` makes them again in the
    caller's process."""
    causes = []
    link = exc.__cause__
    while link is not None and len(causes) < _CAUSES_KEPT:
        causes.append(_link(link))
        link = link.__cause__
    return {**_link(exc), "causes": causes}


def _link(exc: BaseException) -> dict:
    """One error as data: its class name and message; a DMI error also its state as pickle takes
    it (``__reduce__``: the arguments it is made from, and its attributes — ``lost_keys``,
    ``field``, ``settled``, its notes, ...) in plain form (:func:`_plain`). An attribute with no
    plain form (another library's object) stays in the worker, named in a note that crosses."""
    reply = {"error": type(exc).__name__, "message": str(exc)}
    if not isinstance(exc, DMIError):
        return reply
    _, args, *state = exc.__reduce__()
    attrs, behind = {}, []
    for name, value in (state[0] if state and state[0] else {}).items():
        try:
            attrs[name] = _plain(value)
        except TypeError:
            behind.append(name)
    if behind:
        attrs["__notes__"] = [*attrs.get("__notes__", []), f"its attribute(s) {', '.join(behind)} stayed in the "
                              "vLLM worker's process (values that cannot cross it as plain data)"]
    try:
        plain_args = [_plain(arg) for arg in args]
    except TypeError:
        plain_args = [str(exc)]
    return {**reply, "args": plain_args, "attrs": attrs}


def _plain(value):
    """``value`` as data that msgpack and JSON carry unchanged: ``None``, a bool, an int, a float
    or a str as it is; a list as a list; a tuple, a dict and a DMI dataclass (``RecordKey``) as a
    one-key dict saying which (:func:`_unplain` reads them back, types and all). ``TypeError``
    for anything else: it would arrive as another type, or not at all."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return {"tuple": [_plain(v) for v in value]}
    if type(value) is dict:
        return {"dict": [[_plain(k), _plain(v)] for k, v in value.items()]}
    cls = type(value)
    if dataclasses.is_dataclass(value) and cls.__module__.startswith("dmi."):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"dataclass": [f"{cls.__module__}:{cls.__qualname__}", fields]}
    raise TypeError(f"{cls.__qualname__} has no plain form")


def _unplain(data):
    """What :func:`_plain` made ``data`` from."""
    if type(data) is list:
        return [_unplain(v) for v in data]
    if type(data) is not dict:
        return data
    if "tuple" in data:
        return tuple(_unplain(v) for v in data["tuple"])
    if "dict" in data:
        return {_unplain(k): _unplain(v) for k, v in data["dict"]}
    name, fields = data["dataclass"]
    return _dmi_dataclass(name)(**{k: _unplain(v) for k, v in fields.items()})


def _dmi_dataclass(name: str) -> type:
    """The DMI dataclass ``module:qualname`` names; nothing else is made from a reply."""
    module, _, qualname = name.partition(":")
    cls = None
    if module.startswith("dmi."):
        cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise CaptureError(f"a vLLM worker's error reply names {name!r}, which is no DMI dataclass")
    return cls


def raise_replied(replies: list, *, attaching: bool = False) -> list:
    """``replies``, one per worker in rank order (None: a worker with nothing to say), or the
    first error reply among them (:func:`error_reply`) raised as the DMI error the worker
    raised — its class, message and attributes, its cause chain as far as DMI errors make it —
    and, for a capture that failed (not a refusal to attach: every rank refuses alike), the rank
    that raised it and any other rank that failed too in a note (several ranks). Crossing vLLM's
    process boundary as a raised exception, it would reach the caller as vLLM's generic worker
    error, its class and facts lost."""
    failed = [(rank, reply) for rank, reply in enumerate(replies) if reply is not None and "error" in reply]
    if not failed:
        return replies
    (rank, reply), others = failed[0], failed[1:]
    exc = _worker_error(reply, attaching=attaching)
    exc.__cause__ = _causes(reply.get("causes", ()))
    if len(replies) > 1 and not attaching:
        also = "".join(f"; rank {r} raised {other['error']} too" for r, other in others)
        exc.add_note(f"raised in vLLM worker rank {rank} of {len(replies)}{also}")
    raise exc


def _worker_error(reply: dict, *, attaching: bool) -> DMIError:
    """The error a worker raised (refused to attach with, if ``attaching``), made again here
    (:func:`_remade`); one that is no DMI error becomes :class:`AttachError` (attaching) or
    :class:`CaptureError` naming it."""
    made = _remade(reply)
    if made is not None:
        return made
    if attaching:
        return AttachError(f"a vLLM worker refused to attach ({reply['error']}): {reply['message']}")
    return CaptureError(f"a vLLM worker's capture failed ({reply['error']}): {reply['message']}")


def _remade(link: dict) -> DMIError | None:
    """The DMI error ``link`` describes (:func:`_link`), made again as pickle makes it — its class
    called with its arguments (``__reduce__``'s: ``PlanError``'s are its fields), then its
    attributes set. None: ``link`` is no DMI error, or names one its arguments do not make (a
    reply with its message alone, from a class that needs fields)."""
    cls = getattr(errors, link["error"], None)
    if not (isinstance(cls, type) and issubclass(cls, DMIError)):
        return None
    args = tuple(_unplain(arg) for arg in link["args"]) if "args" in link else (link["message"],)
    try:
        exc = cls(*args)
    except TypeError:
        return None
    exc.__dict__.update({name: _unplain(value) for name, value in link.get("attrs", {}).items()})
    return exc


def _causes(chain) -> DMIError | None:
    """A worker error's ``__cause__`` chain (:func:`error_reply`) made again here, outermost
    first, up to its first link that is no DMI error (its text is in the messages above it);
    None if that is the first."""
    made = []
    for link in chain:
        cause = _remade(link)
        if cause is None:
            break
        made.append(cause)
    for outer, inner in zip(made, made[1:]):
        outer.__cause__ = inner
    return made[0] if made else None
