"""Tensors at rest in a scratch file that the kernel pages in and out: the disk tier of
parameter offload (``OffloadPolicy(params="disk")``).

Why a memory map and not chunk reads like :class:`~hetero.offload.disk_file.ChunkFile`: parameters
and gradients are read and written by everything that touches a parameter (autograd, the
optimizer, ``state_dict``, a checkpoint) at any offset and in any order, while the optimizer
state is only ever walked front to back by its own step. Mapped, each tensor is an ordinary host
tensor whose pages come from the file when touched and go back to it when let go of: the kernel
does the IO (readahead, writeback), ``madvise(MADV_WILLNEED)`` starts a layer's reads ahead of its
use, and ``madvise(MADV_DONTNEED)`` with ``posix_fadvise(POSIX_FADV_DONTNEED)`` drops a layer's
pages from the process once its device copy is made (dirty pages keep their data: for a shared
file mapping the kernel writes them back first). ZeRO-Infinity keeps parameters in NVMe files the
same way in spirit (``offload_param: nvme``), with its own swapper instead of the kernel's.

The file is created new (never over another file), its blocks reserved at once
(``posix_fallocate``: a disk too small fails here, naming the bytes), and unlinked as soon as it
is mapped: its blocks belong to this process alone and return to the file system when the process
ends, however it ends (a killed rank leaves nothing behind).
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from hetero.offload.disk_file import open_new, reserve

PAGE = mmap.PAGESIZE
_LIVE: weakref.WeakSet[MappedFile] = weakref.WeakSet()  # for release_pages()


class MappedFile:
    """One tensor per ``(shape, dtype)`` of ``specs``, each starting on a page, in a new file
    under ``directory`` named ``name`` (module docstring). ``random``: the tensors are read and
    written at scattered rows (an embedding table and its optimizer state), so the kernel reads
    only the page a fault asks for: its readahead would otherwise read up to 128 KiB around
    every touched row, many times the bytes a step needs."""

    def __init__(self, directory: str | os.PathLike, name: str,
                 specs: Sequence[tuple[torch.Size, torch.dtype]], random: bool = False) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"MappedFile: {str(directory)!r} is not a directory")
        self.offsets, total = [], 0
        for shape, dtype in specs:
            self.offsets.append(total)
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            total += -(-max(nbytes, 1) // PAGE) * PAGE
        self.path, self.nbytes = directory / name, max(total, PAGE)
        self.fd = open_new(self.path, "MappedFile")
        weakref.finalize(self, os.close, self.fd)
        try:
            reserve(self.fd, self.path, self.nbytes, "MappedFile")
            self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if random:
                self._map.madvise(mmap.MADV_RANDOM)
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        finally:
            self.path.unlink(missing_ok=True)  # the blocks stay ours until the process ends
        self.tensors = [
            torch.frombuffer(self._map, dtype=dtype, count=torch.Size(shape).numel(),
                             offset=offset).view(shape)
            for (shape, dtype), offset in zip(specs, self.offsets, strict=True)]
        self.base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        _LIVE.add(self)

    def _range(self, index: int) -> tuple[int, int]:
        return self.offsets[index], max(self.tensors[index].nbytes, 1)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start reading these tensors' pages from the file (the kernel's readahead)."""
        for index in indices:
            self._map.madvise(mmap.MADV_WILLNEED, *self._range(index))

    def release(self, indices: Sequence[int]) -> None:
        """Let go of these tensors' pages: out of this process's memory now, written back and
        out of the page cache as the kernel gets to it. Their values stay what they were."""
        for index in indices:
            start, length = self._range(index)
            self._map.madvise(mmap.MADV_DONTNEED, start, length)
            os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)


def release_pages(tensor: torch.Tensor) -> None:
    """Let go of the pages of ``tensor``'s memory if it lies in a live :class:`MappedFile`
    (anything else: nothing). For code that walks such tensors without knowing where they rest
    (``DiskAdamW``'s step over weights and gradients on disk): its touched pages leave the
    process as it goes, not at the next forward. Whole pages around the tensor go too, which is
    harmless: a shared file mapping keeps every value."""
    if not _LIVE or tensor.device.type != "cpu":
        return
    start = tensor.data_ptr()
    for file in list(_LIVE):
        if file.base <= start < file.base + file.nbytes:
            first = (start - file.base) // PAGE * PAGE
            end = min(start - file.base + max(tensor.nbytes, 1), file.nbytes)
            file._map.madvise(mmap.MADV_DONTNEED, first, end - first)
            return


def zeros_in_file(directory: str | os.PathLike, name: str, shape: Sequence[int],
                  dtype: torch.dtype, random: bool = False) -> torch.Tensor:
    """A zero tensor of ``shape`` and ``dtype`` at rest in a new :class:`MappedFile` (its
    reserved blocks read as zeros: nothing is written until the tensor is)."""
    return MappedFile(directory, name, [(torch.Size(shape), dtype)], random).tensors[0]
