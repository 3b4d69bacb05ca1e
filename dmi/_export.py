"""Write a tensor read from DMI to a file other tools open: ``.safetensors``, ``.npy``, ``.pt``.

The format is chosen by the file extension. Every format stores the exact values: no
dtype conversion ever happens silently (``.npy`` refuses dtypes numpy cannot hold,
such as ``bfloat16``, instead of widening them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO

import torch

from dmi.storage.errors import InvalidArgumentError

__all__ = ["EXPORT_FORMATS", "export_tensor"]

EXPORT_FORMATS = (".safetensors", ".npy", ".pt")


def export_tensor(tensor: torch.Tensor, path: str | os.PathLike[str], *, name: str) -> str:
    """Write ``tensor`` to ``path``; returns the format used (the extension).

    ``name`` is the tensor's key inside a ``.safetensors`` file. Raises
    ``InvalidArgumentError`` for an unknown extension, a dtype the format cannot
    represent exactly, or a path that cannot be written (no such directory, a directory,
    no permission): the file is opened here, so every format fails the same way.
    """
    out = os.fspath(path)
    ext = os.path.splitext(out)[1].lower()
    if ext not in EXPORT_FORMATS:
        raise InvalidArgumentError(f"cannot tell the format of {out!r}: use one of {', '.join(EXPORT_FORMATS)}")
    write = _writer(tensor.detach().cpu().contiguous(), ext, name=name)
    try:
        handle = open(out, "wb")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write {out}: {exc.strerror or exc}") from exc
    with handle:
        write(handle)
    return ext


def _writer(tensor: torch.Tensor, ext: str, *, name: str) -> Callable[[BinaryIO], object]:
    """What writes ``tensor`` into an open file in format ``ext``; checks that the format
    holds the tensor exactly before the file is created."""
    if ext == ".safetensors":
        from safetensors.torch import save

        return lambda handle: handle.write(save({name: tensor}))
    if ext == ".npy":
        import numpy as np

        try:
            array = tensor.numpy()
        except TypeError as exc:
            raise InvalidArgumentError(
                f"numpy cannot hold {tensor.dtype} exactly; write .safetensors or .pt instead"
            ) from exc
        return lambda handle: np.save(handle, array, allow_pickle=False)
    return lambda handle: torch.save(tensor, handle)
