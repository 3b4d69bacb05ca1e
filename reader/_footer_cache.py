"""FooterCache: a thread-safe LRU of parsed pack footers (record indexes).

Bounded twice: by entry count (default 128) and by the sum of the entries' estimated
sizes (default 64 MiB). Every hit refreshes recency; an entry larger than the whole
byte budget is not admitted (it would only evict everything else and then itself).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from dmi.storage.errors import InvalidArgumentError

__all__ = ["FooterCache", "CacheStats"]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since the cache was created."""

    hits: int
    misses: int
    evictions: int
    rejected: int
    entries: int
    nbytes: int


class FooterCache:
    """LRU over ``key → value`` with an explicit size per value."""

    def __init__(self, max_entries: int = 128, max_bytes: int = 64 * 1024 * 1024):
        if max_entries < 1 or max_bytes < 1:
            raise InvalidArgumentError("FooterCache bounds must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._nbytes = 0
        self._hits = self._misses = self._evictions = self._rejected = 0

    def get(self, key: Hashable) -> Any | None:
        """The cached value (refreshing its recency), or ``None``."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return item[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Insert or replace; evict least recently used entries. False if not admitted."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._nbytes -= old[1]
            if nbytes > self.max_bytes:
                self._rejected += 1
                return False
            self._items[key] = (value, nbytes)
            self._nbytes += nbytes
            while len(self._items) > self.max_entries or self._nbytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self._nbytes -= size
                self._evictions += 1
            return True

    def get_or_load(self, key: Hashable, load: Callable[[], tuple[Any, int]]) -> Any:
        """Cached value, or ``load()`` → ``(value, nbytes)`` cached and returned.

        ``load`` runs outside the lock, so a slow footer read never blocks other keys;
        two threads missing the same key may both load it (the last one is kept).
        """
        value = self.get(key)
        if value is None:
            value, nbytes = load()
            self.put(key, value, nbytes)
        return value

    def discard(self, key: Hashable) -> None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is not None:
                self._nbytes -= item[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._nbytes = 0

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, self._rejected, len(self._items), self._nbytes)

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._items)
