"""Shared-memory arenas: what one side writes the other reads, growth, refusals, and no leftovers."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from storage import shm
from storage.shm import MEMFD_NAME, Arena, ArenaError

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd (Linux)")


def arena_maps() -> int:
    """Mappings of arenas in this process."""
    return Path("/proc/self/maps").read_text().count(f"memfd:{MEMFD_NAME}")


def arena_fds() -> int:
    """Open arena descriptors of this process (each live mapping holds one more: mmap's own)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            continue
    return sum(f"memfd:{MEMFD_NAME}" in link for link in links)


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(-(2**62), 2**62, 1000),  # int64 token ids
        rng.random((7, 3)).astype(np.float32),  # a dense 2-D field
        np.array([np.nan, -0.0, np.inf], np.float64),
        rng.integers(0, 2**16, 5, dtype=np.uint16),  # bfloat16 bits
        rng.random(9) > 0.5,
        np.zeros(0, np.int64),  # an empty column
        np.arange(4, dtype=np.int64)[::2],  # not contiguous: written as its values
    ]


def test_the_peer_reads_exactly_what_was_written() -> None:
    writer = Arena.create()
    reader = Arena(os.dup(writer.fd))  # the shard's side: its own mapping of the same memory
    arrays = _arrays()
    got = reader.read(writer.write(arrays))
    for want, have in zip(arrays, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert have.tobytes() == want.tobytes()  # bitwise: NaN and -0.0 included
    writer.close()
    reader.close()


def test_an_arena_grows_for_a_large_message_and_the_peer_follows() -> None:
    writer = Arena.create()
    reader = Arena(os.dup(writer.fd))
    big = np.arange(3 * shm.MIN_SIZE // 8, dtype=np.int64)  # 3 MiB: past the first size
    layout = writer.write([big])
    assert writer.size == 4 * shm.MIN_SIZE  # 3 MiB and a quarter, in whole MiB
    with pytest.raises(ArenaError, match="do not fit"):
        reader.read(layout)  # not yet mapped at the new size
    reader.follow(writer.size)
    assert np.array_equal(reader.read(layout)[0], big)
    with pytest.raises(ArenaError, match="does not exist"):
        reader.follow(writer.size * 2)  # a size nobody grew it to
    writer.close()
    reader.close()


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ([[0, "|O", [2]]], "plain numeric"),  # raw memory must never become object pointers
        ([[0, "<M8[s]", [2]]], "plain numeric"),
        ([[64, "<i8", [shm.MIN_SIZE]]], "do not fit"),
        ([[3, "<i8", [1]]], "do not fit"),  # misaligned
        ([[-64, "<i8", [1]]], "do not fit"),
    ],
)
def test_bad_layouts_are_refused(layout: shm.Layout, message: str) -> None:
    arena = Arena.create()
    with pytest.raises(ArenaError, match=message):
        arena.read(layout)
    arena.close()


def test_arenas_leave_nothing_in_dev_shm_or_this_process() -> None:
    gc.collect()  # arenas an earlier test in this process left to the collector go first
    maps, fds = arena_maps(), arena_fds()
    writer = Arena.create()
    reader = Arena(os.dup(writer.fd))
    views = reader.read(writer.write(_arrays()))
    assert arena_maps() == maps + 2 and arena_fds() > fds
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("ppoflow")]
    writer.close()
    reader.close()
    del views  # the last views hold the last mapping
    gc.collect()
    assert arena_maps() == maps and arena_fds() == fds
