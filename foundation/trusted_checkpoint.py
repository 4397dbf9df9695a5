"""Reading a DCP checkpoint without running code from it (issue 38).

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``, and
``DefaultLoadPlanner.load_bytes`` reads each byte item (an optimizer's ``param_groups``, a
scheduler's state) with ``torch.load(weights_only=False)``: a checkpoint received from someone
else runs whatever code those files name, on every rank, before a single tensor is read. torch
files DCP under "trusted environment"; this project shares DCP directories as weights, so every
path that reads one (resume, export, ``model.weights``, the integrity and optimizer checks,
sharded loading in ``parallel``) goes through this module instead:

* :func:`read_metadata` unpickles ``.metadata`` with an unpickler that resolves only the globals a
  genuine DCP metadata file holds (its dataclasses, ``torch.Size``, dtypes, the layout and
  memory-format encodings, paths) and refuses any other before it is called, naming the file and
  the global (:class:`UntrustedCheckpointError`);
* :class:`TrustedFileSystemReader` is DCP's reader with that metadata path;
* :class:`TrustedLoadPlanner` is DCP's default planner whose byte items are first decoded with
  ``torch.load(weights_only=True)``.

Why by hand: torch's ``weights_only`` unpickler knows tensors and containers, not DCP's metadata
classes, and DCP offers no restricted reader; ``pickle.Unpickler.find_class`` is Python's own
documented hook for exactly this ("Restricting Globals").
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from foundation.errors import is_collective_failure

__all__ = ["TrustedFileSystemReader", "TrustedLoadPlanner", "UntrustedCheckpointError", "load",
           "read_metadata"]

METADATA_FILE = ".metadata"
#: module -> the names a DCP metadata file may resolve there (torch 2.13's writer)
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # maps "torch.strided" to the layout
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                          "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class UntrustedCheckpointError(ValueError):
    """A checkpoint file names code to run, or is not the file it claims to be."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`_ALLOWED` globals and torch dtypes."""

    def __init__(self, file: io.BufferedIOBase, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(
            f"{self.name}: refused: it names the global {module}.{name}, which a DCP metadata "
            f"file never holds (unpickling it could run code); only DCP's metadata classes, "
            f"torch.Size, dtypes, layouts and paths are read")

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedCheckpointError(f"{self.name}: refused: a persistent id ({pid!r}) is not "
                                       f"part of a DCP metadata file")


def _read(file: str | os.PathLike) -> Metadata:
    name = os.fspath(file)
    with open(name, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle, name).load()
        except UntrustedCheckpointError:
            raise
        except Exception as err:  # truncated, garbage or another format: one line, named
            raise UntrustedCheckpointError(
                f"{name}: not a readable DCP metadata file ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpointError(
            f"{name}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The :class:`Metadata` of the DCP checkpoint directory ``path``, read without running code."""
    return _read(Path(path) / METADATA_FILE)


class TrustedFileSystemReader(FileSystemReader):
    """DCP's file-system reader whose metadata goes through :func:`read_metadata`'s unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read(self._get_metadata_path(kwargs.get("rank")))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:  # as torch's reader does
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class TrustedLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner; a byte item is first decoded with ``torch.load(weights_only=True)``,
    so one that names code is refused before the default planner's ``weights_only=False`` load
    sees it. Decoding twice (the items are small: param groups, scheduler state) reuses the
    default planner's placement of the value instead of copying its private nested-dict code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:  # torch's text: advice, then the reason
            lines = [line for line in str(err).splitlines() if line.strip()]
            reason = next((line for line in lines if "GLOBAL" in line), lines[-1] if lines else "")
            raise UntrustedCheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r}: refused: it is not plain data "
                f"(torch.load(weights_only=True): {reason.strip()})") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, allow_partial: bool = False,
         no_dist: bool = False) -> None:
    """``dcp.load`` of ``path`` into ``state_dict`` in place, through the trusted reader and
    planner. DCP gathers each rank's failure into a ``CheckpointException``, a ``BaseException``
    that ordinary handlers miss: a refusal is raised as itself, and a file that cannot be read
    (truncated, not DCP's) as one :class:`UntrustedCheckpointError` line naming ``path``; a
    failed collective stays a ``CheckpointException`` (``foundation.errors`` names it)."""
    try:
        dcp.load(state_dict, storage_reader=TrustedFileSystemReader(os.fspath(path)),
                 planner=TrustedLoadPlanner(allow_partial_load=allow_partial), no_dist=no_dist)
    except CheckpointException as err:
        refused = [exc for exc, _ in err.failures.values()
                   if isinstance(exc, UntrustedCheckpointError)]
        if refused:
            raise UntrustedCheckpointError(str(refused[0])) from None
        failures = [exc for exc, _ in err.failures.values()]
        if failures and not any(is_collective_failure(exc) for exc in failures):
            first = failures[0]
            text = str(first).strip().splitlines()[0] if str(first).strip() else ""
            raise UntrustedCheckpointError(
                f"{os.fspath(path)}: not a readable checkpoint ({type(first).__name__}: {text}); "
                f"a file was truncated or replaced (checksums.json would name it)") from None
        raise
