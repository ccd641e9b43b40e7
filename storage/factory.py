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

from urllib.parse import parse_qs, urlsplit

from storage.base import DEFAULT_TIMEOUT_S, Store, check_timeout
from storage.errors import StoreError

_PARAMS = {"memory": {"timeout"}, "ray": {"timeout", "shards", "namespace", "transport"}}
_TRANSPORTS = ("auto", "shm", "object_store")


def _query(url: str, scheme: str, query: str) -> dict[str, str]:
    try:
        raw = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise StoreError(f"store URL {url!r}: malformed query: {exc}") from exc
    unknown = sorted(set(raw) - _PARAMS[scheme])
    if unknown:
        raise StoreError(
            f"store URL {url!r}: unknown parameter(s) {unknown}; {scheme}:// takes {sorted(_PARAMS[scheme])}"
        )
    repeated = sorted(name for name, values in raw.items() if len(values) > 1)
    if repeated:
        raise StoreError(f"store URL {url!r}: parameter(s) {repeated} given more than once")
    return {name: values[0] for name, values in raw.items()}


def _number(url: str, params: dict[str, str], name: str, default: float) -> float:
    if name not in params:
        return default
    try:
        return float(params[name])
    except ValueError as exc:
        raise StoreError(f"store URL {url!r}: {name}={params[name]!r} is not a number") from exc


def open_store(url: str = "memory://", *, default_timeout: float | None = None) -> Store:
    """Opens (or attaches to) the store a URL names.

    Raises:
        StoreError: unknown scheme or parameter, bad numbers, or Ray not initialised for ray://.
    """
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in _PARAMS or "://" not in url:
        raise StoreError(f"store URL {url!r}: scheme must be memory:// or ray://NAME")
    params = _query(url, scheme, parts.query)
    timeout = _number(url, params, "timeout", DEFAULT_TIMEOUT_S)
    timeout = check_timeout(timeout if default_timeout is None else default_timeout, "timeout")
    name = parts.netloc + parts.path
    if scheme == "memory":
        from storage.memory import MemoryStore

        return MemoryStore(name, timeout)
    shards = _number(url, params, "shards", 0)
    if shards != int(shards) or shards < 0:
        raise StoreError(f"store URL {url!r}: shards must be a positive integer")
    transport = params.get("transport", "auto")
    if transport not in _TRANSPORTS:
        raise StoreError(f"store URL {url!r}: transport must be one of {list(_TRANSPORTS)}")
    from storage.ray_backend import RayStore

    namespace = params.get("namespace", "ppoflow")
    return RayStore.open(name, int(shards), namespace, timeout, transport)
