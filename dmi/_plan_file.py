"""Capture plans as files: a versioned YAML document loaded into a typed, frozen plan.

A plan says what one capture does — model, hooks, layers, schedule, store, codec, ring,
ids — so that it can be written down, reviewed and rerun. The loader is strict: an unknown
key is an error naming the nearest valid one (a misspelled ``layer:`` must never silently
capture every layer), ``version`` is required, duplicate keys are refused, and every error
is a :class:`~dmi.storage.errors.PlanError` addressed to the field path that caused it.

The loader knows nothing of the runtime: it checks names against the hook catalogue and
values against their types, and :meth:`CapturePlan.attach_options` turns the plan into the
plain keyword arguments ``dmi.capture(model, ...)`` already takes — the one path from file
to runtime. Layer numbers are checked against a model once its layer count is known
(:meth:`CapturePlan.check_layers`). ``load_plan(dump_plan(plan)) == plan``.

Reference: ``docs/plans.md``.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dmi.storage.errors import PlanError

__all__ = ["PLAN_VERSION", "CapturePlan", "RingPlan", "SchedulePlan", "StorePlan", "load_plan", "parse_plan",
           "dump_plan"]

PLAN_VERSION = 1
"""The plan format this DMI reads and writes."""

_PHASES = ("prefill", "decode", "forward")

_MAX_INT = (1 << 63) - 1
"""The largest integer a plan field takes: counts and sizes go to torch and the catalog as
64-bit integers, where a larger one fails deep inside (an overflow, or a drain failure
printing torch's C++ frames) instead of at its field."""


@dataclass(frozen=True, slots=True)
class SchedulePlan:
    """When to capture (the fields of ``dmi.capture.Schedule``)."""

    phases: tuple[str, ...] = _PHASES
    step_stride: int = 1
    request_stride: int = 1
    warmup: int = 0


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Where records go (the arguments of ``dmi.open``); ``None`` = the default."""

    home: str | None = None
    catalog: str | None = None
    packs: str | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.home, self.catalog, self.packs))


@dataclass(frozen=True, slots=True)
class RingPlan:
    """Host memory between the model and the drain thread (``attach``'s ring arguments)."""

    slots: int = 8
    slot_bytes: int = 32 << 20
    timeout: float = 60.0
    drop_policy: str = "wait"


@dataclass(frozen=True, slots=True)
class CapturePlan:
    """One capture, as a plan file describes it.

    ``hooks``: hook names and group tokens as written; ``layers``: ``None`` (all), a
    ``range`` (``"START:STOP"``) or a tuple of layer numbers (negative counts from the end).
    """

    hooks: tuple[str, ...] = ("resid_post",)
    layers: range | tuple[int, ...] | None = None
    model: str | None = None
    model_id: str | None = None
    run_id: str | None = None
    schedule: SchedulePlan = field(default_factory=SchedulePlan)
    store: StorePlan = field(default_factory=StorePlan)
    codec: str | None = None
    ring: RingPlan = field(default_factory=RingPlan)
    decode_chunk_steps: int = 32
    version: int = PLAN_VERSION

    def attach_options(self) -> dict[str, Any]:
        """The keyword arguments of ``dmi.capture(model, ...)`` this plan stands for."""
        options: dict[str, Any] = {
            "hooks": list(self.hooks),
            "layers": list(self.layers) if isinstance(self.layers, tuple) else self.layers,
            "schedule": {"phases": self.schedule.phases, "step_stride": self.schedule.step_stride,
                         "request_stride": self.schedule.request_stride, "warmup": self.schedule.warmup},
            "ring_slots": self.ring.slots,
            "slot_bytes": self.ring.slot_bytes,
            "ring_timeout": self.ring.timeout,
            "drop_policy": self.ring.drop_policy,
            "decode_chunk_steps": self.decode_chunk_steps,
        }
        if self.model_id is not None:
            options["model_id"] = self.model_id
        if self.run_id is not None:
            options["run_id"] = self.run_id
        if self.codec is not None:
            options["writer_options"] = {"codec": self.codec}
        return options

    def check_layers(self, n_layers: int, source: str = "<plan>") -> tuple[int, ...]:
        """The layer numbers this plan selects on a model of ``n_layers`` layers; a layer the
        model does not have is a :class:`PlanError` at ``layers``."""
        what = f"the model has {n_layers} layers (0..{n_layers - 1})"
        if self.layers is None:
            return tuple(range(n_layers))
        if isinstance(self.layers, range):
            if self.layers.stop > n_layers:
                raise PlanError(source, "layers", f"{_layers_text(self.layers)} reaches past the model; {what}")
            return tuple(self.layers)
        for i, v in enumerate(self.layers):
            if not -n_layers <= v < n_layers:
                raise PlanError(source, f"layers[{i}]", f"layer {v} is out of range; {what}")
        return tuple(sorted({v % n_layers for v in self.layers}))


# ----------------------------------------------------------------------------- reading


_TOP = ("version", "model", "model_id", "run_id", "hooks", "layers", "schedule", "store", "codec", "ring",
        "decode_chunk_steps")
_SCHEDULE_KEYS = ("phases", "step_stride", "request_stride", "warmup")
_STORE_KEYS = ("home", "catalog", "packs")
_RING_KEYS = ("slots", "slot_bytes", "timeout", "drop_policy")
_DROP_POLICIES = ("wait", "drop")


def load_plan(path: str | os.PathLike[str]) -> CapturePlan:
    """Read and validate a plan file. Raises :class:`PlanError` (an ``InvalidArgumentError``)."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise PlanError(source, "(file)", f"cannot read the plan: {exc.strerror or exc}") from exc
    return parse_plan(_utf8(data, source), source=source)


def _utf8(data: bytes, source: str) -> str:
    """The plan's bytes as text; bytes that are not UTF-8 are a :class:`PlanError` naming the
    first one and its line (a plan saved as Latin-1 would otherwise escape as a raw
    ``UnicodeDecodeError``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PlanError(source, "(file)", f"not UTF-8 text: byte 0x{data[exc.start]:02x} on line {line} "
                                          "cannot be read; save the plan as UTF-8") from exc


def parse_plan(text: str, *, source: str = "<string>") -> CapturePlan:
    """Validate a plan document given as YAML text (``source`` names it in errors)."""
    import yaml

    loader = _strict_loader()(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_keys(loader, node, "(document)", source, set())
        doc = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise PlanError(source, "(document)", f"not valid YAML: {' '.join(str(exc).split())}") from exc
    except RecursionError as exc:
        raise PlanError(source, "(document)", "nested too deeply to be a plan") from exc
    finally:
        loader.dispose()
    return _Reader(source).plan(doc)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_keys(loader: Any, node: Any, path: str, source: str, seen_nodes: set[int]) -> None:
    """Refuse, at its full field path, a key written twice in one mapping (PyYAML keeps the
    last) and a key that is not a plain scalar (a list or mapping as a key cannot name a
    field, and is not hashable). Merge keys (``<<``) are not keys of their own: the
    mapping's own keys override what they merge, as YAML defines. Walked on the node tree
    before construction, where the path is known; an aliased node is walked once."""
    import yaml

    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_keys(loader, item, f"{path}[{i}]", source, seen_nodes)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    keys = set()
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE_TAG:
            _check_keys(loader, value_node, path, source, seen_nodes)
            continue
        line = key_node.start_mark.line + 1
        key = loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else []
        if not isinstance(key, Hashable):
            raise PlanError(source, path, f"a key must be a field name; got a {key_node.id} (line {line})")
        where = f"{path}.{key}" if path != "(document)" else str(key)
        if key in keys:
            raise PlanError(source, where, f"key {key!r} appears twice (line {line})")
        keys.add(key)
        _check_keys(loader, value_node, where, source, seen_nodes)


@functools.cache
def _strict_loader():
    """A ``yaml.SafeLoader`` that reads integers as YAML 1.2 does (built on first use:
    importing this module loads no YAML)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """Integers in decimal unless written ``0x`` / ``0b``: YAML 1.1 (PyYAML) reads ``010``
        as the octal 8, YAML 1.2 as 10, and a plan means what it shows."""

        def construct_yaml_int(self, node):
            text = self.construct_scalar(node).replace("_", "")
            sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.removeprefix("+"))
            base = {"0x": 16, "0b": 2}.get(digits[:2], 10)
            try:
                return sign * int(digits[2:] if base != 10 else digits, base)
            except ValueError as exc:  # an explicit `!!int` on text that is no integer
                raise yaml.constructor.ConstructorError(None, None, f"not an integer: {text!r}",
                                                        node.start_mark) from exc

    StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
    # YAML 1.1 reads `8:24` as the base-60 integer 504: a layer range written unquoted would
    # silently become one layer. Plans read integers as YAML 1.2 does (no sexagesimal form).
    StrictLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    StrictLoader.add_implicit_resolver(
        "tag:yaml.org,2002:int",
        re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?[0-9][0-9_]*|[-+]?0x[0-9a-fA-F_]+)$"),
        list("-+0123456789"),
    )
    return StrictLoader


class _Reader:
    """Validates one document, addressing every error to its field path."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, reason: str) -> PlanError:
        return PlanError(self.source, path, reason)

    def mapping(self, value: Any, path: str, keys: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be a mapping of {', '.join(keys)}; got {_kind(value)}")
        for key in value:
            if key not in keys:
                near = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.5)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                where = f"{path}.{key}" if path != "(document)" else str(key)
                raise self.fail(where, f"unknown key {key!r}{hint}; valid keys: {', '.join(keys)}")
        return dict(value)

    def plan(self, doc: Any) -> CapturePlan:
        d = self.mapping(doc, "(document)", _TOP)
        if "version" not in d:
            raise self.fail("version", f"required (this DMI reads plan version {PLAN_VERSION})")
        version = self.integer(d["version"], "version", minimum=1, maximum=None)
        if version != PLAN_VERSION:
            raise self.fail("version", f"plan version {version} is not readable by this DMI, which reads "
                                       f"version {PLAN_VERSION}")
        defaults = CapturePlan()
        return CapturePlan(
            version=version,
            model=self.text(d.get("model"), "model"),
            model_id=self.text(d.get("model_id"), "model_id"),
            run_id=self.text(d.get("run_id"), "run_id"),
            hooks=self.hooks(d["hooks"]) if "hooks" in d else defaults.hooks,
            layers=self.layers(d.get("layers")),
            schedule=self.schedule(d.get("schedule", {})),
            store=self.store(d.get("store", {})),
            codec=self.codec(d.get("codec")),
            ring=self.ring(d.get("ring", {})),
            decode_chunk_steps=self.integer(d.get("decode_chunk_steps", defaults.decode_chunk_steps),
                                            "decode_chunk_steps", minimum=1),
        )

    # -- scalars
    def text(self, value: Any, path: str) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, f"must be a non-empty string; got {_kind(value)}")
        return value

    def integer(self, value: Any, path: str, *, minimum: int, maximum: int | None = _MAX_INT) -> int:
        """``value`` as an integer of at least ``minimum`` and at most ``maximum`` (``None``: no bound)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be an integer; got {_kind(value)}")
        if value < minimum:
            raise self.fail(path, f"must be at least {minimum}; got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(path, f"must be at most {maximum} (a 64-bit integer); got {value}")
        return value

    def number(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.fail(path, f"must be a positive number of seconds; got {_kind(value)}")
        return float(value)

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> str:
        if value not in choices:
            near = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise self.fail(path, f"{_kind(value)} is not one of {', '.join(choices)}{hint}")
        return value

    # -- fields
    def hooks(self, value: Any) -> tuple[str, ...]:
        from dmi.capture import GROUPS, HOOKS

        if isinstance(value, str):
            items = [("hooks", p) for p in value.replace(",", " ").split()]
        elif isinstance(value, list):
            items = [(f"hooks[{i}]", v) for i, v in enumerate(value)]
        else:
            raise self.fail("hooks", f"must be a list of hook names or group tokens; got {_kind(value)}")
        if not items:
            raise self.fail("hooks", "selects no hook; name at least one hook or group")
        valid = (*HOOKS, *GROUPS)
        for path, token in items:
            if not isinstance(token, str):
                raise self.fail(path, f"must be a hook name or group token; got {_kind(token)}")
            if token not in valid:
                near = difflib.get_close_matches(token, valid, n=1, cutoff=0.5)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise self.fail(path, f"unknown hook or group {token!r}{hint}; hooks: {', '.join(HOOKS)}; "
                                      f"groups: {', '.join(GROUPS)}")
        self.once(items, "hook or group")
        return tuple(token for _, token in items)

    def once(self, items: list[tuple[str, str]], what: str) -> None:
        """Refuse a name listed twice, at its second place: most likely a typo for another name
        (``[resid_post, resid_post]`` meant ``resid_pre`` too), which a silent dedupe would hide."""
        first: dict[str, str] = {}
        for path, name in items:
            if name in first:
                also = f" (first at {first[name]})" if first[name] != path else ""
                raise self.fail(path, f"{what} {name!r} is listed twice{also}; list each once")
            first[name] = path

    def layers(self, value: Any) -> range | tuple[int, ...] | None:
        if value is None or value == "all":
            return None
        if isinstance(value, bool):
            raise self.fail("layers", f"must be all, START:STOP, a layer number or a list; got {_kind(value)}")
        if isinstance(value, int):
            return (value,)
        if isinstance(value, str):
            return self.layer_range(value)
        if isinstance(value, list):
            if not value:
                raise self.fail("layers", "an empty list selects no layer; omit `layers` (or write all) for all")
            for i, v in enumerate(value):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise self.fail(f"layers[{i}]", f"must be a layer number; got {_kind(v)}")
            return tuple(value)
        raise self.fail("layers", f"must be all, START:STOP, a layer number or a list; got {_kind(value)}")

    def layer_range(self, text: str) -> range:
        """``START:STOP`` (stop excluded) or ``FIRST-LAST`` (both included: the span ``dmi show``
        and ``dmi requests`` print), as the range it names."""
        sep = ":" if ":" in text else "-"
        start, found, stop = text.partition(sep)
        try:
            lo, hi = int(start), int(stop) + (sep == "-")
        except ValueError:
            lo = hi = -1
        if not found or lo < 0 or hi <= lo:
            raise self.fail("layers", f"cannot read {text!r}: write START:STOP with 0 <= START < STOP "
                                      "(stop excluded), FIRST-LAST with FIRST <= LAST (both included), "
                                      "a layer number, a list, or all")
        return range(lo, hi)

    def schedule(self, value: Any) -> SchedulePlan:
        d = self.mapping(value, "schedule", _SCHEDULE_KEYS)
        phases: Any = d.get("phases", list(_PHASES))
        if isinstance(phases, str):
            phases = [phases]
        if not isinstance(phases, list) or not phases:
            raise self.fail("schedule.phases", f"must be a list of {', '.join(_PHASES)}; got {_kind(phases)}")
        for i, p in enumerate(phases):
            self.choice(p, f"schedule.phases[{i}]", _PHASES)
        self.once([(f"schedule.phases[{i}]", p) for i, p in enumerate(phases)], "phase")
        return SchedulePlan(
            phases=tuple(phases),
            step_stride=self.integer(d.get("step_stride", 1), "schedule.step_stride", minimum=1),
            request_stride=self.integer(d.get("request_stride", 1), "schedule.request_stride", minimum=1),
            warmup=self.integer(d.get("warmup", 0), "schedule.warmup", minimum=0),
        )

    def store(self, value: Any) -> StorePlan:
        d = self.mapping(value, "store", _STORE_KEYS)
        return StorePlan(**{k: self.text(d.get(k), f"store.{k}") for k in _STORE_KEYS})

    def codec(self, value: Any) -> str | None:
        from dmi.storage import CODECS

        return None if value is None else self.choice(value, "codec", tuple(CODECS))

    def ring(self, value: Any) -> RingPlan:
        d = self.mapping(value, "ring", _RING_KEYS)
        default = RingPlan()
        slots = self.integer(d.get("slots", default.slots), "ring.slots", minimum=1)
        slot_bytes = self.integer(d.get("slot_bytes", default.slot_bytes), "ring.slot_bytes", minimum=16)
        if slots * slot_bytes > _MAX_INT:
            raise self.fail("ring", f"{slots} slots of {slot_bytes} bytes is {slots * slot_bytes} bytes of host "
                                    f"memory, past {_MAX_INT} (a 64-bit size); lower ring.slots or ring.slot_bytes")
        return RingPlan(
            slots=slots,
            slot_bytes=slot_bytes,
            timeout=self.number(d.get("timeout", default.timeout), "ring.timeout"),
            drop_policy=self.choice(d.get("drop_policy", default.drop_policy), "ring.drop_policy", _DROP_POLICIES),
        )


def _kind(value: Any) -> str:
    if isinstance(value, (Mapping, list)):
        return f"a {type(value).__name__}"
    return repr(value)


# ----------------------------------------------------------------------------- writing


def _layers_text(layers: range | tuple[int, ...] | None) -> Any:
    if layers is None:
        return "all"
    if isinstance(layers, range):
        return f"{layers.start}:{layers.stop}"
    return list(layers)


def dump_plan(plan: CapturePlan) -> str:
    """The plan as a YAML document (every field written out); ``parse_plan`` reads it back equal."""
    doc: dict[str, Any] = {"version": plan.version}
    for key in ("model", "model_id", "run_id"):
        if getattr(plan, key) is not None:
            doc[key] = getattr(plan, key)
    doc["hooks"] = list(plan.hooks)
    doc["layers"] = _layers_text(plan.layers)
    s = plan.schedule
    doc["schedule"] = {"phases": list(s.phases), "step_stride": s.step_stride,
                       "request_stride": s.request_stride, "warmup": s.warmup}
    store = {k: getattr(plan.store, k) for k in _STORE_KEYS if getattr(plan.store, k) is not None}
    if store:
        doc["store"] = store
    if plan.codec is not None:
        doc["codec"] = plan.codec
    r = plan.ring
    doc["ring"] = {"slots": r.slots, "slot_bytes": r.slot_bytes, "timeout": r.timeout, "drop_policy": r.drop_policy}
    doc["decode_chunk_steps"] = plan.decode_chunk_steps
    return dump_document(doc)


def dump_document(doc: dict[str, Any]) -> str:
    """YAML as DMI writes it: mappings as blocks, lists of plain values on one line, keys in the
    given order."""
    import yaml

    return yaml.dump(doc, Dumper=_plan_dumper(), sort_keys=False, default_flow_style=False)


@functools.cache
def _plan_dumper():
    """A ``yaml.SafeDumper`` writing mappings as blocks, lists of plain values on one line
    (``[a, b]``) and lists of mappings as blocks (one ``- name: ...`` entry after another)."""
    import yaml

    class PlanDumper(yaml.SafeDumper):
        def represent_list(self, data):
            flow = not any(isinstance(item, (dict, list)) for item in data)
            return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    PlanDumper.add_representer(list, PlanDumper.represent_list)
    return PlanDumper
