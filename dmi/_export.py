"""Write a tensor read from DMI to a file other tools open: ``.safetensors``, ``.npy``, ``.pt``.

The format is chosen by the file extension. Every format stores the exact values: no
dtype conversion ever happens silently (``.npy`` refuses dtypes numpy cannot hold,
such as ``bfloat16``, instead of widening them).
"""

from __future__ import annotations

import os

import torch

from dmi.storage.errors import InvalidArgumentError

__all__ = ["EXPORT_FORMATS", "export_tensor"]

EXPORT_FORMATS = (".safetensors", ".npy", ".pt")


def export_tensor(tensor: torch.Tensor, path: str | os.PathLike[str], *, name: str) -> str:
    """Write ``tensor`` to ``path``; returns the format used (the extension).

    ``name`` is the tensor's key inside a ``.safetensors`` file. Raises
    ``InvalidArgumentError`` for an unknown extension or a dtype the format cannot
    represent exactly.
    """
    out = os.fspath(path)
    ext = os.path.splitext(out)[1].lower()
    if ext not in EXPORT_FORMATS:
        raise InvalidArgumentError(f"cannot tell the format of {out!r}: use one of {', '.join(EXPORT_FORMATS)}")
    contiguous = tensor.detach().cpu().contiguous()
    if ext == ".safetensors":
        from safetensors.torch import save_file

        save_file({name: contiguous}, out)
    elif ext == ".npy":
        import numpy as np

        try:
            array = contiguous.numpy()
        except TypeError as exc:
            raise InvalidArgumentError(
                f"numpy cannot hold {tensor.dtype} exactly; write .safetensors or .pt instead"
            ) from exc
        np.save(out, array, allow_pickle=False)
    else:
        torch.save(contiguous, out)
    return ext
