"""Store URLs: `memory://[NAME]` and `ray://NAME?shards=N&namespace=NS&transport=T`, with an
optional `timeout=SECONDS` on either (see `storage.factory.open_store`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from storage.base import DEFAULT_TIMEOUT_S, check_timeout
from storage.errors import StoreError

_PARAMS = {"memory": {"timeout"}, "ray": {"timeout", "shards", "namespace", "transport"}}
TRANSPORTS = ("auto", "shm", "object_store")


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL; `shards` 0 means the backend's default."""

    scheme: str
    name: str
    timeout: float
    shards: int = 0
    namespace: str = "ppoflow"
    transport: str = "auto"


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


def parse_store_url(url: str, *, default_timeout: float | None = None) -> StoreURL:
    """Checks and splits a store URL; `default_timeout` wins over the URL's `timeout`.

    Raises:
        StoreError: unknown scheme or parameter, bad numbers.
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
        return StoreURL(scheme, name, timeout)
    shards = _number(url, params, "shards", 0)
    if shards != int(shards) or shards < 0:
        raise StoreError(f"store URL {url!r}: shards must be a positive integer")
    transport = params.get("transport", "auto")
    if transport not in TRANSPORTS:
        raise StoreError(f"store URL {url!r}: transport must be one of {list(TRANSPORTS)}")
    namespace = params.get("namespace", "ppoflow")
    return StoreURL(scheme, name, timeout, int(shards), namespace, transport)
