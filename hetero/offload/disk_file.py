"""A scratch file of equal chunks, read and written at their offsets on IO threads.

What the disk tier stores (``hetero.offload.DiskAdamW``'s FP32 master weights and moments) lives
in one file per rank, cut into chunks of one size; a chunk is read into, and written from, a
caller's buffer while the caller computes on another.

Why positional reads and writes on threads: ``os.preadv`` / ``os.pwritev`` release the GIL, so
two threads (one reading chunk i+1, one writing chunk i-1) keep the disk busy while the main
thread updates chunk i, with no library to build. DeepSpeed's ``aio`` op (libaio, ZeRO-Infinity's
swapper) needs ``libaio-dev`` and a C++ build (2.5 minutes here); with both, the same chunked
write-then-read pass moved 1.25-1.32 GB/s through it (1 MiB blocks, queue depth 8 to 32) against
1.45-1.87 GB/s through these threads, on the same directory in the same runs
(``benchmarks/disk_optimizer.py`` prints both). ``io_uring`` has no well-kept Python binding.

A chunk may be cut into ``planes`` equal parts, each kept in its own region of the file (plane
q of chunk i at ``q * chunks * part + i * part``): DiskAdamW's master weights, first and second
moments are three planes, so each of them is one contiguous array in the file, and
:meth:`ChunkFile.plane` maps it as a tensor — what a checkpoint reads and writes in place of a
state dict in memory. A chunk still moves as one unit (one positional read or write per plane).

Direct IO (``O_DIRECT``, Linux) bypasses the page cache — what a state larger than the memory
needs, or the cache would evict the process's own memory to hold it: the buffers are aligned to
:data:`ALIGN` (:func:`aligned_empty`) and every chunk is a multiple of it. A file system that
refuses ``O_DIRECT`` (tmpfs) falls back to buffered IO, which :attr:`ChunkFile.direct` reports.

The file is the run's own: created new (never over another file), its blocks reserved at once
(``posix_fallocate``: a disk too small fails here, naming the bytes, not in a later step), removed
by :meth:`close` and when the object is collected or the interpreter exits; nothing else in the
directory is touched.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from foundation import device as hd

ALIGN = 4096  # bytes: the page size and the block size direct IO needs on common disks


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D host tensor of ``numel`` elements starting at an :data:`ALIGN`
    boundary (direct IO reads into and writes from it), pinned where an accelerator is present
    (the updated master goes from it to the device's weights without a staging copy)."""
    size = torch.tensor([], dtype=dtype).element_size()
    spare = ALIGN // size
    raw = hd.pinned_empty((numel + spare,), dtype)
    skip = (-raw.data_ptr() % ALIGN) // size
    return raw[skip:skip + numel]


def _remove(path: Path, fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    path.unlink(missing_ok=True)


def open_new(path: Path, who: str, flags: int = 0) -> int:
    """A file descriptor of a new file at ``path``, read-write, created by this call and never
    over another file (``flags``: more ``os.O_*``); a directory this process cannot write to and
    an existing file are refused naming ``who`` and the path."""
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{who}: {path.parent} is not writable by this process")
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o600)
    except FileExistsError:
        raise FileExistsError(f"{who}: {path} exists; the disk tier writes only files it creates "
                              f"(another run's, or a stale one: remove it or choose another "
                              f"path)") from None


def reserve(fd: int, path: Path, nbytes: int, who: str) -> None:
    """Reserve ``nbytes`` of blocks for ``fd`` now (``posix_fallocate``), so a disk that fills
    later cannot fail a write; a shortfall is refused naming the bytes and the space free."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # pragma: no cover (macOS, Windows)
            os.ftruncate(fd, nbytes)
    except OSError as err:
        free = shutil.disk_usage(path.parent).free
        raise OSError(err.errno, f"{who}: cannot reserve {nbytes} bytes for {path} "
                      f"({err.strerror}; {free} bytes free there)") from None


class ChunkFile:
    """``chunks`` chunks of ``chunk_bytes`` each in a new file ``path``, every chunk cut into
    ``planes`` parts kept in one region of the file each (module docstring)."""

    def __init__(self, path: str | os.PathLike, chunks: int, chunk_bytes: int,
                 direct: bool = True, planes: int = 1) -> None:
        if planes < 1 or chunk_bytes % (ALIGN * planes):
            raise ValueError(f"ChunkFile: chunk_bytes={chunk_bytes} must be a multiple of "
                             f"{ALIGN} per plane ({planes} planes)")
        self.path = Path(path)
        self.chunks, self.chunk_bytes, self.planes = chunks, chunk_bytes, planes
        self.part = chunk_bytes // planes  # one plane's bytes of one chunk
        self._map: mmap.mmap | None = None
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = open_new(self.path, "ChunkFile", os.O_DIRECT)
                self.direct = True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                # the file system has no direct IO (tmpfs): the kernel created the file
                # (O_EXCL passed, so it is ours) before refusing the flag; buffered instead
                self.path.unlink(missing_ok=True)
        if not self.direct:
            self.fd = open_new(self.path, "ChunkFile")
        self._cleanup = weakref.finalize(self, _remove, self.path, self.fd)
        try:  # every block reserved now: a disk that fills later cannot fail a step's write
            reserve(self.fd, self.path, chunks * chunk_bytes, "ChunkFile")
        except OSError:
            self.close()
            raise
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="disk-write")

    def _check(self, index: int, buffer: torch.Tensor) -> memoryview:
        if not 0 <= index < self.chunks:
            raise IndexError(f"ChunkFile: chunk {index} of {self.chunks}")
        if buffer.nbytes != self.chunk_bytes or not buffer.is_contiguous() \
                or buffer.device.type != "cpu":
            raise ValueError(f"ChunkFile: a chunk buffer is a contiguous host tensor of "
                             f"{self.chunk_bytes} bytes, got {buffer.nbytes} on {buffer.device}")
        if self.direct and buffer.data_ptr() % ALIGN:
            raise ValueError("ChunkFile: direct IO needs a buffer from aligned_empty()")
        array: Any = buffer.numpy()  # the same memory, as a buffer the os calls take
        return memoryview(array).cast("B")

    def _at(self, plane: int, index: int) -> int:
        """Where plane ``plane`` of chunk ``index`` starts in the file."""
        return (plane * self.chunks + index) * self.part

    def _planes(self, index: int, view: memoryview) -> Iterator[tuple[memoryview, int]]:
        """(the part of ``view``, its offset in the file) for each plane of chunk ``index``."""
        for plane in range(self.planes):
            yield view[plane * self.part:(plane + 1) * self.part], self._at(plane, index)

    def _read(self, index: int, view: memoryview) -> None:
        for part, at in self._planes(index, view):
            done = 0
            while done < self.part:  # a positional read may return fewer bytes
                got = os.preadv(self.fd, [part[done:]], at + done)
                if got <= 0:
                    raise OSError(f"ChunkFile: {self.path} ended inside chunk {index}")
                done += got

    def _write(self, index: int, view: memoryview) -> None:
        try:
            for part, at in self._planes(index, view):
                done = 0
                while done < self.part:
                    done += os.pwritev(self.fd, [part[done:]], at + done)
        except OSError as err:
            raise OSError(err.errno, f"ChunkFile: writing chunk {index} of {self.path} failed "
                          f"({err.strerror})") from None

    def read(self, index: int, buffer: torch.Tensor) -> Future:
        """Start reading chunk ``index`` into ``buffer``; the future completes when it is in."""
        return self._reader.submit(self._read, index, self._check(index, buffer))

    def write(self, index: int, buffer: torch.Tensor) -> Future:
        """Start writing ``buffer`` as chunk ``index``; ``buffer`` must not change until the
        future completes."""
        return self._writer.submit(self._write, index, self._check(index, buffer))

    def plane(self, index: int, dtype: torch.dtype, start: int = 0,
              count: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + count)`` of plane ``index`` (all of it by default; the
        plane runs through every chunk in order) as a 1-D tensor of ``dtype`` over a shared
        memory map of the file: reading it pages the file in, writing it writes the file. Its
        storage is exactly that memory (a checkpoint writer copies a view of a larger storage
        first, and keeps the copy until its file is written). Only between reads and writes
        (none in flight); :meth:`unmap_pages` lets its pages go before the next positional IO."""
        if not 0 <= index < self.planes:
            raise IndexError(f"ChunkFile: plane {index} of {self.planes}")
        size = torch.tensor([], dtype=dtype).element_size()
        total = self.chunks * self.part // size
        count = total - start if count is None else count
        if start < 0 or count < 0 or start + count > total:
            raise IndexError(f"ChunkFile: elements [{start}, {start + count}) of a plane of "
                             f"{total}")
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.chunks * self.chunk_bytes, mmap.MAP_SHARED)
        if count == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=count,
                                offset=self._at(index, 0) + start * size)

    def unmap_pages(self) -> None:
        """Write what the planes' tensors changed back to the file and let go of their pages
        (their values stay: the mapping is the file), so positional reads and direct IO see
        the file alone. A no-op when no plane was taken."""
        if self._map is not None:
            self._map.flush()
            self._map.madvise(mmap.MADV_DONTNEED)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Wait for the IO in flight, then remove the file."""
        for pool in ("_reader", "_writer"):
            if hasattr(self, pool):
                getattr(self, pool).shutdown(wait=True)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a plane's tensor still lives: the map goes with the last
                pass
            self._map = None
        self._cleanup()
