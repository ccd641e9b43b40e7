"""`open_store(url)`: the one way to get a store.

- `memory://` a private in-process store; `memory://NAME` one shared by name within the process;
- `ray://NAME?shards=2&namespace=ppoflow` shards as named Ray actors on the current Ray instance
  (another process opening the same URL reaches the same store); `&transport=` picks how data
  reaches them: `auto` (default: shared memory for shards on this node, Ray's object store for
  the others), `shm` (shared memory or an error) or `object_store` (always Ray calls);
- `?timeout=SECONDS` on either sets the default get timeout (300 s unless given), as does the
  `default_timeout` argument, which wins over the URL.
"""

from __future__ import annotations

from storage.base import Store
from storage.urls import parse_store_url


def open_store(url: str, *, default_timeout: float | None = None) -> Store:
    """Opens (or attaches to) the store a URL names.

    Raises:
        StoreError: unknown scheme or parameter, bad numbers, or Ray not initialised for ray://.
    """
    parsed = parse_store_url(url, default_timeout=default_timeout)
    if parsed.scheme == "memory":
        from storage.memory import MemoryStore

        return MemoryStore(parsed.name, parsed.timeout)
    from storage.ray_backend import RayStore

    return RayStore.open(
        parsed.name, parsed.shards, parsed.namespace, parsed.timeout, parsed.transport
    )
