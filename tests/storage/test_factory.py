"""open_store URLs: schemes, parameters, timeouts and named in-process stores."""

from __future__ import annotations

import pytest
import torch

from storage import StoreError, open_store


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://x", "scheme"),
        ("memory", "scheme"),
        ("memory://?shards=2", "unknown parameter"),
        ("memory://?timeout=soon", "not a number"),
        ("memory://?timeout=-1", ">= 0"),
        ("memory://?timeout=1&timeout=2", "more than once"),
        ("ray://x?shards=1.5", "positive integer"),
    ],
)
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(url)


def test_timeouts_come_from_the_url_or_the_argument() -> None:
    assert open_store("memory://").default_timeout == 300
    assert open_store("memory://?timeout=2.5").default_timeout == 2.5
    assert open_store("memory://?timeout=2.5", default_timeout=7).default_timeout == 7


def test_named_memory_stores_are_shared_within_the_process() -> None:
    first, second, private = (
        open_store("memory://flow"),
        open_store("memory://flow"),
        open_store("memory://"),
    )
    first.kv_batch_put(["a"], "p", {"scores": torch.ones(1)})
    assert second.kv_list("p") == {"a": ["scores"]}
    assert private.kv_list("p") == {}
    first.close()
    assert open_store("memory://flow").kv_list("p") == {}  # a closed name starts afresh
