"""DMI: capture the internals of a language model, keep them, query them, read them back.

::

    import dmi

    with dmi.open() as store:                       # embedded chDB catalog + local packs
        with dmi.capture(model, hooks="resid,attn", layers=range(8), store=store) as cap:
            request_ids, out = cap.generate(input_ids, attention_mask, max_new_tokens=32)
        x = store.get_internal(cap.model_id, request_ids[0], "resid_post")   # [layers, tokens, hidden]
        store.sql("SELECT layer, avg(l2_norm) FROM {records} WHERE hook = 'resid_post' GROUP BY layer")

``dmi.capture`` is both the capture package (``dmi.capture.attach``, ``dmi.capture.HOOKS``)
and, called, the facade's capture context manager: whichever way the package is first
imported (``dmi.capture`` as an attribute, or ``import dmi.capture``), it is bound here as a
callable module, so the two spellings the design promises cannot shadow each other. Every
error DMI raises is re-exported here (root: ``DMIError``).

Everything but the error tree is imported on first use (module ``__getattr__``): ``import
dmi``, ``import dmi.catalog`` and ``dmi --help`` load no torch, pyarrow or model code.
Reference: ``docs/api.md``.
"""

import importlib as _importlib
import sys as _sys
import types as _types

from dmi.storage import errors as _errors
from dmi.storage.errors import *  # noqa: F403

__version__ = "0.1.0"

_LAZY = {
    "open": "dmi._store",
    "capture_vllm": "dmi._store",
    "Store": "dmi._store",
    "default_home": "dmi._store",
    "load_model": "dmi._models",
    "LoadedModel": "dmi._models",
    "LazyInternal": "dmi._lazy",
    "ModelSummary": "dmi._values",
    "RequestSummary": "dmi._values",
    "HookSummary": "dmi._values",
    "RequestContents": "dmi._values",
    "Loss": "dmi._values",
    "VerifyReport": "dmi._values",
    "Problem": "dmi._values",
    "RecoveredPack": "dmi._values",
    "TokenLoader": "dmi._loader",
    "ShuffleQuality": "dmi._loader",
    "RunSummary": "dmi._values",
    "DeleteReport": "dmi._values",
    "RequestTokens": "dmi._tokens",
    "AuditReport": "dmi._audit",
    "AuditCheck": "dmi._audit",
    "CapturePlan": "dmi._plan_file",
    "load_plan": "dmi._plan_file",
    "dump_plan": "dmi._plan_file",
}

__all__ = [
    "__version__",
    "open",
    "capture",
    "capture_vllm",
    "Store",
    "LazyInternal",
    "ModelSummary",
    "RequestSummary",
    "HookSummary",
    "RequestContents",
    "Loss",
    "VerifyReport",
    "Problem",
    "RecoveredPack",
    "TokenLoader",
    "ShuffleQuality",
    "RunSummary",
    "DeleteReport",
    "AuditReport",
    "AuditCheck",
    "default_home",
    "load_model",
    "LoadedModel",
    "CapturePlan",
    "load_plan",
    "dump_plan",
    "RequestTokens",
    *_errors.__all__,
]


class _CallableCapturePackage(_types.ModuleType):
    """The ``dmi.capture`` package, callable as :func:`dmi._store.capture`."""

    def __call__(self, model, **options):
        from dmi._store import capture as capture_facade

        return capture_facade(model, **options)


class _Facade(_types.ModuleType):
    """The ``dmi`` module: makes the capture package callable however it gets bound here
    (the import system binds a subpackage with ``setattr`` on its parent)."""

    def __setattr__(self, name, value):
        if name == "capture" and isinstance(value, _types.ModuleType):
            value.__class__ = _CallableCapturePackage
        super().__setattr__(name, value)


def __getattr__(name: str):
    if name == "capture":
        return _importlib.import_module("dmi.capture")
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_sys.modules[__name__].__class__ = _Facade
