"""Shared memory between a store client and a shard on one node: one reusable arena per connection.

An arena is an anonymous memfd (named `ppoflow-arena` in /proc, never a file in /dev/shm): the
client creates it and hands its descriptor to the shard over their Unix socket
(`storage.channel`), and both map it whole. Every message of that connection reuses it: a put's
columns are written into it by the client and copied out by the shard; a get's rows are written
by the shard and copied out by the client. A connection carries one request at a time, so the
whole arena belongs to the message in flight and needs no allocator. Nothing is ever unlinked:
the kernel frees the memory when both sides have closed the descriptor and dropped the mapping
(a closed connection, a killed process).

Reuse is the point. A fresh segment per call pays the kernel's page allocation on every call
(many times the copy itself); an arena pays it once, when it grows. Arrays placed in an arena are plain numeric numpy dtypes at 64-byte
aligned offsets, described by a layout `[[offset, dtype.str, shape], ...]` that travels in the
message header.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from storage.columnar import AnyArray

MEMFD_NAME = "ppoflow-arena"  # how arenas show up in /proc/PID/fd and /proc/PID/maps
MIN_SIZE = 1 << 20  # an arena starts at 1 MiB and grows in whole MiB, 25% past what it must hold
_ALIGN = 64
_PLAIN_KINDS = "biuf"  # bool, signed, unsigned, float: what columns hold; never object pointers

Layout = list[list[Any]]  # per array: [offset, dtype str, shape]


def available() -> bool:
    """Whether this platform has what arenas need: memfd and passing descriptors on sockets."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class ArenaError(Exception):
    """A layout that does not fit the arena or names a dtype an arena cannot hold."""


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _size_for(nbytes: int) -> int:
    wanted = nbytes + nbytes // 4  # room for a somewhat larger next message without regrowing
    return max(MIN_SIZE, -(-wanted // MIN_SIZE) * MIN_SIZE)


class Arena:
    """One side's mapping of a connection's shared memory."""

    def __init__(self, fd: int) -> None:
        """Takes ownership of `fd` (closed by `close`, or when the arena is garbage-collected)."""
        self.fd = fd
        self.size = 0
        self._map: mmap.mmap | None = None
        self._close_fd = weakref.finalize(self, os.close, fd)
        self._remap(os.fstat(fd).st_size)

    @classmethod
    def create(cls, size: int = MIN_SIZE) -> Arena:
        """A new arena of `size` bytes (the client's side; send `fd` to the shard)."""
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd)
        except BaseException:
            os.close(fd)
            raise

    def _remap(self, size: int) -> None:
        # MAP_POPULATE faults every page in now, once, instead of one fault per page per use.
        # Views of an older, smaller mapping stay valid until they are dropped.
        self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.size = size

    def reserve(self, nbytes: int) -> None:
        """Grows the arena (file and this side's mapping) to hold `nbytes`; never shrinks it."""
        if nbytes > self.size:
            size = _size_for(nbytes)
            os.ftruncate(self.fd, size)
            self._remap(size)

    def follow(self, size: int) -> None:
        """Maps the arena at the size the other side grew it to (a no-op if already mapped)."""
        if size > self.size:
            if os.fstat(self.fd).st_size < size:
                raise ArenaError(f"the peer announced an arena of {size} bytes that does not exist")
            self._remap(size)

    def write(self, arrays: Sequence[AnyArray]) -> Layout:
        """Copies `arrays` into the arena (one copy each) and returns where they are."""
        layout: Layout = []
        end = 0
        for array in arrays:
            offset = _aligned(end)
            layout.append([offset, array.dtype.str, list(array.shape)])
            end = offset + array.nbytes
        self.reserve(end)
        for (offset, _, _), array in zip(layout, arrays):
            if array.nbytes:
                np.copyto(self._view(offset, array.dtype, array.shape), array, casting="no")
        return layout

    def read(self, layout: Layout) -> list[AnyArray]:
        """Views of the arrays a layout describes: valid until the next message, so copy them."""
        arrays = []
        for offset, dtype_str, shape in layout:
            dtype = np.dtype(dtype_str)
            if dtype.kind not in _PLAIN_KINDS or dtype.hasobject:
                raise ArenaError(f"an arena holds plain numeric arrays, not dtype {dtype_str!r}")
            arrays.append(self._view(int(offset), dtype, tuple(int(n) for n in shape)))
        return arrays

    def _view(self, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> AnyArray:
        nbytes = dtype.itemsize * math.prod(shape)  # plain ints: np.prod costs ~10 us a call
        if nbytes == 0:
            return np.empty(shape, dtype)
        if offset < 0 or offset % _ALIGN or offset + nbytes > self.size:
            raise ArenaError(
                f"{nbytes} bytes at offset {offset} do not fit an arena of {self.size}"
            )
        return np.ndarray(shape, dtype, buffer=self._map, offset=offset)

    def probe(self, token: bytes | None = None) -> bytes:
        """Writes `token` at the start of the arena, or reads back what is there (handshake)."""
        assert self._map is not None
        if token is not None:
            self._map[: len(token)] = token
            return token
        return bytes(self._map[:16])

    def close(self) -> None:
        """Closes this side's descriptor; the mapping goes when the last view of it does."""
        self._close_fd()
        self.fd = -1
        self._map = None
