"""What a capturing child process writes down for its parent: JSON lines and tensor digests.

The crash harness (``bench/crash_harness.py``) and the many-writers test (``tests/_writers.py``)
start children that capture and note every record they append (key + SHA-256 of its bytes);
the parent reads the lines after the child is gone — killed with SIGKILL, in the harness — and
checks what the store holds against them.
"""

from __future__ import annotations

import hashlib
import json
import threading

__all__ = ["SideFile", "tensor_digest"]


class SideFile:
    """JSON lines, written through line by line: a line written is in the kernel, so a SIGKILL
    of the child cannot lose it."""

    def __init__(self, path: str):
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the child's life
        self._lock = threading.Lock()

    def write(self, **event) -> None:
        with self._lock:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def tensor_digest(tensor) -> str:
    """SHA-256 of a tensor's bytes, as stored (what a reader must get back bit for bit)."""
    import torch

    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
