"""A CPU-safe stand-in for vLLM's own hidden-states extractor, for ``bench_vllm.py``.

vLLM's ``extract_hidden_states`` speculative method caches the chosen layers' hidden states in
a KV-cache-like buffer; its ``ExampleHiddenStatesConnector`` writes each finished request's
rows to one safetensors file. On a CPU engine the connector fails: it copies device to host
through a CUDA stream, CUDA events and ``pin_memory=True`` host tensors. ``CPUHiddenStatesConnector``
changes exactly that and nothing else (:data:`CHANGES`); it is registered the supported way,
``kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector",
"kv_connector_module_path": "_vllm_native"}`` (this directory on ``sys.path``).
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

CHANGES = (
    "CPUHiddenStatesConnector(ExampleHiddenStatesConnector) overrides _submit_async_write only: the rows are "
    "gathered from the hidden-states cache on the calling thread (no CUDA copy stream, no CUDA event, no "
    "pin_memory=True host tensor) and written with safetensors.save_file synchronously before the method "
    "returns (no thread pool), then the request's lock is released; in place of the CUDA event that "
    "get_finished polls it records an already-completed marker, so the request is reported done on the same "
    "call. What it writes, and when vLLM asks for it (the engine step after a "
    "request finishes), are unchanged."
)


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, host-only write (see :data:`CHANGES`)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("CPUHiddenStatesConnector: no hidden-states cache registered before a write")
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _WRITTEN


class _Written:
    """Stands where the connector keeps a request's CUDA copy event: the write already happened."""

    @staticmethod
    def query() -> bool:
        return True


_WRITTEN = _Written()
