"""The payload of DMI's string records (``token_text``, ``prompt_text``), without torch.

Payload (``uint8``, one dimension): ``k`` as int32, then ``k`` int32 byte lengths
(``-1``: an id the tokenizer has no string for, read back as ``None``), then the strings'
UTF-8 bytes back to back; all little-endian. :func:`encode_strings` writes it,
:func:`decode_strings` reads it. The capture side (``dmi.capture._token_text``) builds these
payloads from token ids; ``dmi show`` reads them back without loading torch.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from dmi.storage.errors import PackCorruptError

__all__ = ["NO_STRING", "encode_strings", "pack_strings", "decode_strings"]

NO_STRING = -1
"""The byte length that stands for a string the tokenizer does not have (read back as ``None``)."""
_INT32 = struct.Struct("<i")


def encode_strings(strings: Sequence[str | None]) -> np.ndarray:
    """``strings`` as one ``uint8`` payload (the format in the module docstring)."""
    encoded = [b"" if s is None else s.encode("utf-8") for s in strings]
    lengths = np.array([NO_STRING if s is None else len(b) for s, b in zip(strings, encoded)], dtype=np.int64)
    return pack_strings(lengths, b"".join(encoded))


def pack_strings(lengths: np.ndarray, text: bytes) -> np.ndarray:
    """Header (count, lengths: little-endian int32) then the text bytes, as one writable ``uint8`` array."""
    header = np.concatenate([[len(lengths)], lengths]).astype("<i4").tobytes()
    return np.frombuffer(bytearray(header + text), dtype=np.uint8)  # never empty: the count is there


def decode_strings(payload, where: str) -> tuple[str | None, ...]:
    """The strings of one payload. ``where`` names the record in the error: a payload that
    does not parse (it passed its checksum, so it was written wrong) is a
    ``PackCorruptError``."""
    data = np.asarray(payload).astype(np.uint8, copy=False).tobytes()
    try:
        (count,) = _INT32.unpack_from(data, 0)
        if count < 0:
            raise ValueError(f"a negative string count {count}")
        lengths = struct.unpack_from(f"<{count}i", data, _INT32.size)
        offset = _INT32.size * (count + 1)
        strings: list[str | None] = []
        for length in lengths:
            if length == NO_STRING:
                strings.append(None)
                continue
            if length < 0 or offset + length > len(data):
                raise ValueError(f"a string of {length} bytes at byte {offset} of {len(data)}")
            strings.append(data[offset : offset + length].decode("utf-8"))
            offset += length
        if offset != len(data):
            raise ValueError(f"{len(data) - offset} bytes after the last string")
    except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise PackCorruptError(f"{where}: the token text payload does not parse: {exc}") from exc
    return tuple(strings)
