"""DMI: capture the internals of a language model, keep them, query them, read them back.

::

    import dmi

    with dmi.open() as store:                       # embedded chDB catalog + local packs
        with dmi.capture(model, hooks="resid,attn", layers=range(8), store=store) as cap:
            request_ids, out = cap.generate(input_ids, attention_mask, max_new_tokens=32)
        x = store.get_internal(cap.model_id, request_ids[0], "resid_post")   # [layers, tokens, hidden]
        store.sql("SELECT layer, avg(l2_norm) FROM {records} WHERE hook = 'resid_post' GROUP BY layer")

``dmi.capture`` is both the capture package (``dmi.capture.attach``, ``dmi.capture.HOOKS``)
and, called, the facade's capture context manager: the package is imported here and made
callable, so the two spellings the design promises cannot shadow each other whichever is
imported first. Every error DMI raises is re-exported here (root: ``DMIError``).
Reference: ``docs/api.md``.
"""

import types as _types

from dmi.catalog import errors as _errors
from dmi.catalog.errors import *  # noqa: F403

__version__ = "0.1.0"

import dmi.capture as _capture_package  # noqa: E402  (after the errors it imports)
from dmi._lazy import LazyInternal  # noqa: E402
from dmi._store import Store, default_home, open  # noqa: E402
from dmi._store import capture as _capture_facade  # noqa: E402
from dmi._values import (  # noqa: E402
    HookSummary,
    Loss,
    ModelSummary,
    Problem,
    RecoveredPack,
    RequestContents,
    RequestSummary,
    VerifyReport,
)


class _CallableCapturePackage(_types.ModuleType):
    """The ``dmi.capture`` package, callable as :func:`dmi._store.capture`."""

    def __call__(self, model, **options):
        return _capture_facade(model, **options)


_capture_package.__class__ = _CallableCapturePackage
capture = _capture_package

__all__ = [
    "__version__",
    "open",
    "capture",
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
    "default_home",
    *_errors.__all__,
]
