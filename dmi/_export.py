"""Write a tensor read from DMI to a file other tools open: ``.safetensors``, ``.npy``, ``.pt``.

The format is chosen by the file extension. Every format stores the exact values: no
dtype conversion ever happens silently (``.npy`` refuses dtypes numpy cannot hold,
such as ``bfloat16``, instead of widening them). A file is written under a temporary name
beside its final one and renamed into place when complete, so a write that fails (disk
full, a file size limit) or is interrupted (Ctrl-C) leaves nothing behind, not a truncated
file under the final name.

Values stored with a lossy codec (``fp8``, ``int8``) are decoded approximations: given their
:class:`CodecLoss`, a ``.safetensors`` file records it in its ``__metadata__``; ``.npy`` and
``.pt`` have no metadata to carry it, so :func:`loss_note` gives the line the CLI prints to
stderr instead. Lossless values carry no such mark.
"""

from __future__ import annotations

import errno
import math
import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from dmi.storage.errors import InvalidArgumentError, ExportError

__all__ = ["EXPORT_FORMATS", "CodecLoss", "check_format", "export_tensor", "loss_note", "worst_error", "write_file"]

EXPORT_FORMATS = (".safetensors", ".npy", ".pt")

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""Errors of a file that cannot even be created because its disk (or quota) is full: not a
bad path, but the condition a write that fails part-way reports (:class:`ExportError`)."""


@dataclass(frozen=True, slots=True)
class CodecLoss:
    """That some values were stored with a lossy codec: the codecs (sorted, lossless ones
    included where records mix them) and the worst error measured when they were written
    (the catalog's ``codec_max_abs_error`` / ``codec_rel_l2_error``, in the captured values'
    units; ``None`` where a record's error is NaN, its values held one)."""

    codecs: tuple[str, ...]
    max_abs_error: float | None
    rel_l2_error: float | None

    @classmethod
    def of(cls, metas: Iterable[Any]) -> "CodecLoss | None":
        """The loss of the records ``metas`` (``RecordMeta``s); ``None`` when every codec is lossless."""
        from dmi.storage import LOSSY_CODECS

        metas = list(metas)
        codecs = tuple(sorted({m.codec for m in metas}))
        if not set(codecs) & set(LOSSY_CODECS):
            return None
        return cls(codecs, worst_error(m.codec_max_abs_error for m in metas),
                   worst_error(m.codec_rel_l2_error for m in metas))

    def metadata(self) -> dict[str, str]:
        """The ``.safetensors`` ``__metadata__`` entries saying so (strings, as the format requires)."""
        return {"dmi_lossy": "true", "dmi_codecs": ",".join(self.codecs),
                "dmi_codec_max_abs_error": _number(self.max_abs_error),
                "dmi_codec_rel_l2_error": _number(self.rel_l2_error)}


def worst_error(errors: Iterable[float]) -> float | None:
    """The largest of ``errors``; ``None`` when one is NaN (the worst cannot be told)."""
    worst = 0.0
    for error in errors:
        if math.isnan(error):
            return None
        worst = max(worst, error)
    return worst


def _number(value: float | None) -> str:
    """A worst error as text: ``repr`` of the float (exact), ``"unknown"`` for ``None``."""
    return "unknown" if value is None else repr(value)


def loss_note(path: str | os.PathLike[str], loss: CodecLoss | None) -> str | None:
    """The line saying that ``path`` holds lossy values where its format cannot record it
    (``.npy``, ``.pt``); ``None`` for lossless values and for ``.safetensors`` (its metadata says so)."""
    out = os.fspath(path)
    ext = os.path.splitext(out)[1].lower()
    if loss is None or ext == ".safetensors":
        return None
    return (f"note: {out} holds lossy values (decoded from records stored with {', '.join(loss.codecs)}; worst "
            f"absolute error {_number(loss.max_abs_error)}, relative L2 {_number(loss.rel_l2_error)} at capture); "
            f"{ext} has no metadata to record it, .safetensors does")


def export_tensor(tensor: torch.Tensor, path: str | os.PathLike[str], *, name: str,
                  loss: CodecLoss | None = None) -> str:
    """Write ``tensor`` to ``path``; returns the format used (the extension).

    ``name`` is the tensor's key inside a ``.safetensors`` file; ``loss``, when the values
    were stored with a lossy codec, goes into its ``__metadata__`` (:meth:`CodecLoss.metadata`;
    other formats have none: see :func:`loss_note`). Raises
    ``InvalidArgumentError`` for an unknown extension, a dtype the format cannot
    represent exactly, or a path that cannot be written (no such directory, a directory,
    no permission): checked before anything is written, so every format fails the same way.
    Raises ``ExportError`` (an ``OSError``) when writing fails part-way (disk full, a file
    size limit): the partial file is removed and ``path`` is left as it was. Whatever else
    stops the write (Ctrl-C, a bug) removes the partial file too, and is raised as it is.
    """
    out = os.fspath(path)
    ext = os.path.splitext(out)[1].lower()
    if ext not in EXPORT_FORMATS:
        raise InvalidArgumentError(f"cannot tell the format of {out!r}: use one of {', '.join(EXPORT_FORMATS)}")
    tensor = tensor.detach().cpu().contiguous()
    check_format(tensor.dtype, ext)
    write_file(out, _writer(tensor, ext, name=name, metadata=loss.metadata() if loss is not None else None))
    return ext


def write_file(out: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Write the file ``out`` with ``write(handle)``: under a temporary name beside it, renamed
    into place when complete, so no failed or interrupted write leaves a partial file under
    ``out``. A file that cannot be started raises ``InvalidArgumentError`` (``out`` is a
    directory, no such directory, no permission) or ``ExportError`` (a full disk); a write that
    fails part-way raises ``ExportError`` (an ``OSError``) and removes the partial file;
    whatever else stops the write (Ctrl-C, a bug) removes it too and is raised as it is."""
    out = os.fspath(out)
    if os.path.isdir(out):
        raise InvalidArgumentError(f"cannot write {out}: Is a directory")
    handle, temp = _open_temp(out)
    try:
        with handle:
            write(handle)
        os.replace(temp, out)
    except BaseException as exc:
        _remove(temp)
        if isinstance(exc, OSError):
            raise _export_error(out, exc) from exc
        raise


def _export_error(out: str, exc: OSError) -> ExportError:
    """The :class:`ExportError` of ``out`` not written because of ``exc`` (a full disk, a file size limit)."""
    return ExportError(f"could not write {out} ({exc.strerror or exc}); nothing was written: "
                       "make room there (or lift the file size limit) or export elsewhere")


def check_format(dtype: torch.dtype, ext: str) -> None:
    """Refuse, with ``InvalidArgumentError``, a ``dtype`` that format ``ext`` cannot hold
    exactly (``.npy``: what numpy lacks, such as ``bfloat16``); called before any writing."""
    if ext != ".npy":
        return
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError as exc:
        raise InvalidArgumentError(f"numpy cannot hold {dtype} exactly; write .safetensors or .pt instead, or widen "
                                   "it to float32, which holds it exactly (--dtype float32)") from exc


def _open_temp(out: str) -> tuple[BinaryIO, str]:
    """A new file beside ``out`` (same directory, so the final rename cannot cross file
    systems; permissions from the umask, as ``open`` gives), open for writing, and its name;
    ``InvalidArgumentError`` when none can be made."""
    directory, base = os.path.split(out)
    temp = os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.part")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise _export_error(out, exc) from exc
        raise InvalidArgumentError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return os.fdopen(fd, "wb"), temp


def _remove(temp: str) -> None:
    """Remove a partial file; one already gone is fine (the error being raised says why)."""
    try:
        os.unlink(temp)
    except FileNotFoundError:
        pass


def _writer(tensor: torch.Tensor, ext: str, *, name: str,
            metadata: dict[str, str] | None) -> Callable[[BinaryIO], object]:
    """What writes ``tensor`` (a dtype ``check_format`` took) into an open file in format
    ``ext``; ``metadata``: a ``.safetensors`` file's ``__metadata__`` (other formats have none)."""
    if ext == ".safetensors":
        from safetensors.torch import save

        return lambda handle: handle.write(save({name: tensor}, metadata=metadata))
    if ext == ".npy":
        import numpy as np

        return lambda handle: np.save(handle, tensor.numpy(), allow_pickle=False)
    return lambda handle: _torch_save(_compact(tensor), handle)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of exactly its own bytes: ``torch.save`` writes a tensor's
    whole storage, so a view (a slice of a larger buffer, such as a loader's last, shorter
    batch) would carry the buffer's other values into the file, hidden from ``torch.load``'s
    tensor but there on disk. A copy is made only when the storage holds more."""
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone()


def _torch_save(tensor: torch.Tensor, handle: BinaryIO) -> None:
    """``torch.save`` into ``handle``, raising what stopped the write itself.

    torch reports a failed ``handle.write`` (disk full, Ctrl-C) as a ``RuntimeError``
    (``[enforce fail at inline_container.cc:...] unexpected pos``) whose context is the
    write's own exception; that exception is raised instead (from the ``RuntimeError``), so
    that a full disk becomes ``ExportError`` and Ctrl-C stays ``KeyboardInterrupt``. A
    ``RuntimeError`` without such a context (not the write's) is raised as it is."""
    try:
        torch.save(tensor, handle)
    except RuntimeError as exc:
        cause = exc.__context__
        if isinstance(cause, OSError) or (cause is not None and not isinstance(cause, Exception)):
            raise cause from exc
        raise
