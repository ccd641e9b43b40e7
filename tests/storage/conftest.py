"""Fixtures for store tests: both backends behind one `store` fixture, unique partition ids.

The Ray stores are session-wide pairs of shards on the lead's `ray_local` instance, one reached
the default way (shared memory on this node) and one forced through Ray's object store; each test
uses its own partition, so tests stay independent without paying for new actors each time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from storage import Store, open_store


@pytest.fixture(scope="session")
def ray_store(ray_local: object) -> Iterator[Store]:
    store = open_store(f"ray://tests-{uuid.uuid4().hex[:8]}?shards=2&timeout=30")
    yield store
    store.close()


@pytest.fixture(scope="session")
def ray_object_store(ray_local: object) -> Iterator[Store]:
    store = open_store(
        f"ray://tests-{uuid.uuid4().hex[:8]}?shards=2&timeout=30&transport=object_store"
    )
    yield store
    store.close()


@pytest.fixture(params=["memory", "ray", "ray-object-store"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each test runs against the embedded store and the Ray store over both of its transports."""
    if request.param == "memory":
        memory = open_store("memory://", default_timeout=30)
        yield memory
        memory.close()
    elif request.param == "ray":
        yield request.getfixturevalue("ray_store")
    else:
        yield request.getfixturevalue("ray_object_store")


@pytest.fixture
def pid() -> str:
    """A partition id no other test uses."""
    return f"test/{uuid.uuid4().hex[:10]}"
