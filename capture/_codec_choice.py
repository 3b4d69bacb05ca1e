"""Which codec each captured hook is stored with: ``attach(..., codec=...)``.

``codec`` is one codec name for every record of the capture (the writer's codec), or a
mapping ``{hook: codec}`` for some hooks (the others keep the writer's codec). The lossy
codecs (``fp8``, ``int8``) are refused, before the model is touched, for hooks whose values
are integers (``token_ids``, ``router_topk``) and for the token text a tokenizer adds:
:class:`LossyCodecError` names them.
"""

from __future__ import annotations

from collections.abc import Mapping

from dmi.storage import CODECS, LOSSY_CODECS
from dmi.storage.errors import InvalidArgumentError, LossyCodecError

from ._hooks import HOOKS, ModelGeometry

__all__ = ["resolve_codecs"]


def resolve_codecs(codec, writer_options: dict | None, hooks, geometry: ModelGeometry,
                   with_text: bool) -> tuple[dict | None, dict[str, str]]:
    """``(writer_options, {hook: codec})`` for ``codec``, refused where it cannot apply.

    ``hooks``: the hook names this capture writes; ``with_text``: a tokenizer adds token text."""
    _check_writer_options(writer_options)
    if codec is None:
        whole = (writer_options or {}).get("codec")
        _check_lossy(whole, hooks, geometry, with_text)
        return writer_options, {}
    if isinstance(codec, str):
        _check_name(codec)
        if writer_options and "codec" in writer_options and writer_options["codec"] != codec:
            raise InvalidArgumentError(f"codec={codec!r} and writer_options codec {writer_options['codec']!r} disagree")
        _check_lossy(codec, hooks, geometry, with_text)
        return {**(writer_options or {}), "codec": codec}, {}
    if not isinstance(codec, Mapping):
        raise InvalidArgumentError(f"codec must be a codec name or {{hook: codec}}, got {codec!r}")
    for hook, name in codec.items():
        if hook not in hooks:
            raise InvalidArgumentError(f"codec names hook {hook!r}, which this capture does not write; "
                                       f"it writes {', '.join(sorted(hooks))}")
        _check_name(name)
        _check_lossy(name, (hook,), geometry, False)
    others = [hook for hook in hooks if hook not in codec]  # these, and token text, keep the writer's codec
    _check_lossy((writer_options or {}).get("codec"), others, geometry, with_text)
    return writer_options, dict(codec)


WRITER_OPTIONS = ("writer_id", "codec", "max_records", "max_bytes", "stats", "batch_bytes")
"""The :class:`~dmi.storage.PackWriter` arguments a capture's ``writer_options`` may set (the
session sets ``on_seal`` itself)."""


def _check_writer_options(writer_options) -> None:
    """``writer_options`` is None or a mapping of :data:`WRITER_OPTIONS`: anything else would fail
    only when the writer is made, as a ``TypeError``."""
    if writer_options is None:
        return
    if not isinstance(writer_options, Mapping):
        raise InvalidArgumentError(f"writer_options must be a dict of PackWriter arguments, got {writer_options!r}")
    unknown = sorted(set(writer_options) - set(WRITER_OPTIONS))
    if unknown:
        raise InvalidArgumentError(f"writer_options {unknown} are not PackWriter arguments a capture sets; "
                                   f"choose from {', '.join(WRITER_OPTIONS)}")


def _check_name(name) -> None:
    if name not in CODECS and name not in LOSSY_CODECS:
        raise InvalidArgumentError(f"unknown codec {name!r}; choose one of {', '.join(CODECS + LOSSY_CODECS)}")


def _check_lossy(name, hooks, geometry: ModelGeometry, with_text: bool) -> None:
    if name not in LOSSY_CODECS:
        return
    integer = sorted(h for h in hooks if not HOOKS[h].dtype(geometry).is_floating_point)
    if with_text:
        integer.append("token text (tokenizer=)")
    if integer:
        raise LossyCodecError(
            f"codec {name!r} is lossy and stores floating-point values only; {', '.join(integer)} "
            f"hold integers: leave them out, or give codec={{hook: {name!r}}} for the float hooks only"
        )
