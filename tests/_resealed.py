"""A pack and its re-sealed copy: one id, one size, other values (a restored backup, a pack
sealed again), for the tests that a reader does not read one through the other's footer."""

from __future__ import annotations

import types
from unittest import mock

import torch

from dmi.storage import PackWriter

SEAL_TIME = 1_796_585_198.18635
"""Both are sealed at this time: the footer holds the seal time as text, whose length varies
with the clock (a flake: 8458 and 8450 bytes in one CI run)."""


def write_same_size_packs(stores, pack_id: str, key) -> None:
    """Write pack ``pack_id`` into each of ``stores``: one record under ``key``, a ``[3, 8]``
    float32 tensor of 1.0 in the first, 2.0 in the second."""
    clock = types.SimpleNamespace(time=lambda: SEAL_TIME)
    with mock.patch("dmi.storage._writer.secrets.token_hex", return_value=pack_id), \
            mock.patch("dmi.storage._writer.time", clock):
        for value, store in zip((1.0, 2.0), stores):
            with PackWriter(store, codec="raw") as writer:
                writer.append(key, torch.full((3, 8), value))
