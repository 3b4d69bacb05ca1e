"""Fetching records as torch tensors: :mod:`dmi.reader._raw`'s checked bytes, viewed.

:func:`read_record` does one range read; :func:`read_records` executes :func:`plan_reads`
(one read per planned range, straight into one buffer) and decodes every member.
``raw`` records come back as views of that buffer — no copy — so keeping one alive keeps
its whole read range alive. With a :class:`FooterCache`, each entry is also checked against
its pack's own index first (:mod:`dmi.reader._raw`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dmi.storage import PackStore, torch_dtype
from dmi.storage.records import PackDescriptor, RecordEntry, RecordKey
from dmi.reader._footer_cache import FooterCache
from dmi.reader._ranges import DEFAULT_MAX_GAP
from dmi.reader._raw import check_raw_records, find_in_footer, load_footer, read_raw_record, read_raw_records

__all__ = ["read_record", "read_records", "read_by_key", "check_records"]


def read_by_key(store: PackStore, pack_id: str, key: RecordKey, *, cache: FooterCache | None = None) -> torch.Tensor:
    """Locate ``key`` through the (cached) footer of the file opened, then one range read."""
    with store.open_input(pack_id) as source:
        entry = find_in_footer(load_footer(store, pack_id, cache=cache, source=source), pack_id, key)
        return as_tensor(entry, read_raw_record(source, entry))


def read_record(store: PackStore, entry: RecordEntry, *, cache: FooterCache | None = None) -> torch.Tensor:
    """One record with one range read; checksum verified before decoding."""
    return read_records(store, [entry], cache=cache)[0]


def read_records(
    store: PackStore,
    entries: Sequence[RecordEntry],
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    cache: FooterCache | None = None,
    memory: Callable[[int], torch.Tensor] | None = None,
    direct: bool = False,
) -> list[torch.Tensor]:
    """Tensors for ``entries`` (same order), reading exactly ``plan_reads(entries, max_gap=)``
    (:func:`dmi.reader._raw.read_raw_records`, whose arguments these are; ``memory(nbytes)``
    gives ``uint8`` tensors here, default new NumPy buffers the tensors then view)."""
    entries = list(entries)
    lent = None if memory is None else (lambda nbytes: memory(nbytes).numpy())
    raws = read_raw_records(store, entries, max_gap=max_gap, cache=cache, memory=lent, direct=direct)
    return [as_tensor(e, raw) for e, raw in zip(entries, raws)]


def check_records(descriptor: PackDescriptor, data, entries: Sequence[RecordEntry]) -> None:
    """Read ``entries`` (rows of the pack ``descriptor`` indexes) back from ``data``, the pack's
    whole file already in memory (uint8): each checked against the pack's own index, its
    checksum and its decoding, as :func:`read_records` with a fresh cache checks them, with
    no read of the file. Raises the first failure's :class:`PackError`. Each decoded record is
    dropped at once: ``dmi verify`` checks, it keeps nothing (``verify_pack``'s checks of the
    same bytes: ``dmi.storage.check_whole_pack``)."""
    check_raw_records(descriptor, np.asarray(data), entries)


def as_tensor(entry: RecordEntry, raw: np.ndarray) -> torch.Tensor:
    """The record's tensor over its decoded bytes ``raw`` (shared, not copied)."""
    dtype = torch_dtype(entry.meta.dtype)
    if not raw.size:  # NumPy may give an empty array any stride; torch views only unit strides
        return torch.empty(entry.meta.shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(entry.meta.shape)
