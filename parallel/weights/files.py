"""Weight files a model's values can be read from, a rank's block at a time.

``open_weights(path)`` takes a ``.safetensors`` file, a HuggingFace ``save_pretrained``
directory (``model.safetensors``, or ``model.safetensors.index.json`` mapping each name to its
shard file) or a torch DCP directory (a ``.metadata`` file beside its ``.distcp`` files). Every
source answers its keys and their global shapes from the headers alone (no tensor is read), and
``fill(targets)`` copies into each target — a whole tensor, or a ``DTensor`` whose local shard
gets the block at its global offset — only the bytes that target holds:

* safetensors: ``safe_open(...).get_slice(key)[block]`` reads just the block's rows/columns
  (never ``get_tensor`` of a whole sharded tensor); ``bytes_read`` counts what came back;
* DCP: ``torch.distributed.checkpoint.load`` with the targets themselves, so DCP plans and
  reads only the saved chunks overlapping this rank's shards (collective: every rank calls it).

Pickle checkpoints (``pytorch_model.bin``, ``.pt``) are refused by name: they load whole.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from foundation import trusted_checkpoint
from foundation.compat import dtensor_slice

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"


class WeightsSource(Protocol):
    """What the loader needs of a weights source."""

    path: Path

    def shapes(self) -> dict[str, torch.Size]:
        """Every tensor key of the source -> its global shape (headers only)."""

    def where(self, key: str) -> str:
        """The file holding ``key`` (for error messages)."""

    def fill(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Copy each key's block into its target (whole tensor or DTensor shard)."""


def _block(target: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor to write and the index of the global tensor it holds."""
    if isinstance(target, DTensor):
        return target.to_local(), dtensor_slice(target)
    return target, tuple(slice(0, n) for n in target.shape)


class SafetensorsWeights:
    """One ``.safetensors`` file, or a HuggingFace directory's files (see the module doc)."""

    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        self.path = path
        self._files = files  # key -> file
        #: bytes of the blocks returned by get_slice so far (what "reads only its share" means)
        self.bytes_read = 0
        self._shapes: dict[str, torch.Size] = {}
        for file, keys in self._by_file(files).items():
            try:
                with safe_open(file, framework="pt") as handle:
                    held = set(handle.keys())
                    for key in keys:
                        if key not in held:
                            raise ValueError(f"weights: {path} maps '{key}' to {file.name}, "
                                             f"which does not hold it (a stale index?)")
                        self._shapes[key] = torch.Size(handle.get_slice(key).get_shape())
            except ValueError:
                raise
            except Exception as err:  # safetensors raises its own SafetensorError
                raise ValueError(f"weights: {file} is not a readable safetensors file: "
                                 f"{err}") from err

    @staticmethod
    def _by_file(files: Mapping[str, Path]) -> dict[Path, list[str]]:
        grouped: dict[Path, list[str]] = {}
        for key, file in files.items():
            grouped.setdefault(file, []).append(key)
        return grouped

    def shapes(self) -> dict[str, torch.Size]:
        return dict(self._shapes)

    def where(self, key: str) -> str:
        return str(self._files.get(key, self.path))

    def read(self, handle: Any, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The block ``index`` of ``key`` from an open file: only its bytes are read."""
        if not index:  # a 0-d tensor has no slice syntax; it is one element
            block = handle.get_tensor(key)
        else:
            block = handle.get_slice(key)[index]
        self.bytes_read += block.numel() * block.element_size()
        return block

    def fill(self, targets: Mapping[str, torch.Tensor]) -> None:
        wanted = {key: self._files[key] for key in targets}
        with ExitStack() as stack, torch.no_grad():
            for file, keys in self._by_file(wanted).items():
                handle = stack.enter_context(safe_open(file, framework="pt"))
                for key in keys:
                    local, index = _block(targets[key])
                    if local.numel() == 0:  # a rank holding none of it (uneven shards)
                        continue
                    local.copy_(self.read(handle, key, index))


class DcpWeights:
    """A torch DCP directory; read through ``torch.distributed.checkpoint.load``.

    A training checkpoint of the recipe nests the model's state under ``model.`` beside the
    optimizer's: ``namespace`` is that prefix when the model's names are found under it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        metadata = trusted_checkpoint.read_metadata(path).state_dict_metadata
        self._all = {key: md.size for key, md in metadata.items()
                     if isinstance(md, TensorStorageMetadata)}
        self.namespace = ""

    def use_namespace(self, names: set[str]) -> None:
        """Read keys under ``model.`` when more of ``names`` are found there than bare."""
        bare = sum(name in self._all for name in names)
        nested = sum(f"model.{name}" in self._all for name in names)
        self.namespace = "model." if nested > bare else ""

    def shapes(self) -> dict[str, torch.Size]:
        n = len(self.namespace)
        return {key[n:]: torch.Size(size) for key, size in self._all.items()
                if key.startswith(self.namespace)}

    def where(self, key: str) -> str:
        return str(self.path)

    def fill(self, targets: Mapping[str, torch.Tensor]) -> None:
        state = {self.namespace + key: target for key, target in targets.items()}
        with torch.no_grad(), warnings.catch_warnings():
            # one process without a group is meant here: DCP would warn it assumed so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # every rank calls this (DCP plans collectively), each with its own targets
            trusted_checkpoint.load(state, self.path, no_dist=not dist.is_initialized())


def _index_files(directory: Path) -> dict[str, Path]:
    index = directory / INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"weights: {index} is not a safetensors index (a JSON object with a "
                         f"'weight_map' of tensor name -> shard file): {err}") from err
    files = {key: directory / name for key, name in weight_map.items()}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise FileNotFoundError(f"weights: {index} names the shard file {file.name}, which "
                                    f"is not in {directory}")
    return files


def _file_keys(file: Path) -> dict[str, Path]:
    try:
        with safe_open(file, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), file)
    except Exception as err:  # safetensors raises its own SafetensorError
        raise ValueError(f"weights: {file} is not a readable safetensors file: {err}") from err


def open_weights(path: str | Path) -> SafetensorsWeights | DcpWeights:
    """The source at ``path`` (see the module docstring); FileNotFoundError when it is not
    there, ValueError naming the path and the kinds taken when it is none of them."""
    if not isinstance(path, (str, Path)):
        raise TypeError(f"weights: expected a path (str or Path), got {type(path).__name__}")
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"weights: {path} does not exist (a .safetensors file, a "
                                f"save_pretrained directory or a DCP directory)")
    if path.is_file():
        if path.suffix == ".safetensors":
            return SafetensorsWeights(path, _file_keys(path))
        raise ValueError(f"weights: {path} is not a .safetensors file; sharded loading reads "
                         f"a .safetensors file, a save_pretrained directory ({SAFETENSORS} or "
                         f"{INDEX}) or a DCP directory (pickle checkpoints load whole)")
    if (path / INDEX).is_file():
        return SafetensorsWeights(path, _index_files(path))
    if (path / SAFETENSORS).is_file():
        return SafetensorsWeights(path, _file_keys(path / SAFETENSORS))
    if (path / DCP_METADATA).is_file():
        return DcpWeights(path)
    found = sorted(p.name for p in path.iterdir())[:8]
    raise ValueError(f"weights: directory {path} has no {SAFETENSORS}, {INDEX} or DCP "
                     f"{DCP_METADATA} (it holds {found}); sharded loading reads safetensors "
                     f"(save_pretrained(..., safe_serialization=True)) or DCP checkpoints")

