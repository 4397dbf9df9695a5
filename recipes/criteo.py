"""Criteo-format click logs: the reader, the hashing of categorical values, and training batches.

The format is Criteo's display-advertising TSV (the Kaggle ``train.txt`` and the terabyte
``day_N`` files): per line a 0/1 label, 13 integer features and 26 categorical features (hex
strings, already hashed by Criteo), tab-separated; any feature may be empty (missing).

* integer features become ``sign(x) * log1p(|x|)`` (counts span many orders of magnitude; a few
  columns hold small negatives), missing ones 0;
* categorical values are hashed into one id space of ``vocab_size`` buckets shared by all 26
  fields, salted by field (``zlib.crc32`` with the field as the starting value, the same on every
  machine and in every process, unlike Python's ``hash``); a missing value is a bucket of its own
  per field, so "missing" can carry signal as it does in the real data.

Batches are a pure function of (seed, step, rank, world size), like the GPT recipe's: the global
batch is drawn with a generator seeded by (seed, step) and rank r takes the r-th slice, so N ranks
together see exactly the batch one process would, and resuming needs no loader state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import zlib
from pathlib import Path

import torch

from recipes.corpus import batch_seed

NUM_DENSE, NUM_SPARSE = 13, 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE


@dataclasses.dataclass
class CriteoData:
    """Rows of a Criteo file: labels ``[N]`` (float 0/1), dense ``[N, 13]``, ids ``[N, 26]``."""

    labels: torch.Tensor
    dense: torch.Tensor
    ids: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, index: torch.Tensor | slice) -> CriteoData:
        return CriteoData(self.labels[index], self.dense[index], self.ids[index])

    def split(self, eval_fraction: float) -> tuple[CriteoData, CriteoData]:
        """(train, eval): the last ``eval_fraction`` of the rows are held out for evaluation."""
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={eval_fraction} must be between 0 and 1")
        n_eval = max(1, round(len(self) * eval_fraction))
        if n_eval >= len(self):
            raise ValueError(f"{len(self)} rows are too few to hold out {eval_fraction:.0%}")
        return self.rows(slice(0, len(self) - n_eval)), self.rows(slice(len(self) - n_eval, None))


def dense_feature(text: str) -> float:
    """One integer feature as the model sees it: ``sign(x) * log1p(|x|)``, 0 when missing."""
    if not text:
        return 0.0
    x = int(text)
    return math.copysign(math.log1p(abs(x)), x)


class CategoryHasher:
    """Hashes (field, value) into ``[0, vocab_size)``; remembers values it has seen (values repeat
    a lot in click logs, so most lookups skip the hash)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self._seen: list[dict[str, int]] = [{} for _ in range(NUM_SPARSE)]

    def __call__(self, field: int, value: str) -> int:
        seen = self._seen[field]
        bucket = seen.get(value)
        if bucket is None:
            bucket = seen[value] = zlib.crc32(value.encode(), field + 1) % self.vocab_size
        return bucket


def parse_line(line: str, hasher: CategoryHasher, where: str) -> tuple[float, list, list]:
    """(label, 13 dense values, 26 ids) of one TSV line; ValueError at ``where`` if malformed."""
    cols = line.rstrip("\r\n").split("\t")
    if len(cols) != NUM_COLUMNS or cols[0] not in ("0", "1"):
        raise ValueError(f"{where}: expected a 0/1 label, {NUM_DENSE} integer and {NUM_SPARSE} "
                         f"categorical tab-separated columns, got {len(cols)} columns "
                         f"starting {line[:40]!r}")
    try:
        dense = [dense_feature(c) for c in cols[1:1 + NUM_DENSE]]
    except ValueError:
        raise ValueError(f"{where}: integer features must be integers or empty: "
                         f"{cols[1:1 + NUM_DENSE]}") from None
    ids = [hasher(f, c) for f, c in enumerate(cols[1 + NUM_DENSE:])]
    return float(cols[0]), dense, ids


def read_criteo(path: str | os.PathLike, vocab_size: int, max_rows: int | None = None
                ) -> CriteoData:
    """Read (the first ``max_rows`` lines of) a Criteo-format TSV file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no Criteo file at {path} (set data.path, or null to generate "
                                f"one)")
    hasher = CategoryHasher(vocab_size)
    labels, dense, ids = [], [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if max_rows is not None and n > max_rows:
                break
            label, d, i = parse_line(line, hasher, f"{path}:{n}")
            labels.append(label)
            dense.append(d)
            ids.append(i)
    if not labels:
        raise ValueError(f"{path} holds no rows")
    return CriteoData(torch.tensor(labels), torch.tensor(dense, dtype=torch.float32),
                      torch.tensor(ids, dtype=torch.int64))


def load_criteo(path: str | os.PathLike, vocab_size: int, max_rows: int | None,
                cache_dir: str | os.PathLike) -> CriteoData:
    """``read_criteo``, cached as tensors in ``cache_dir``: parsing runs at Python speed (~40 k
    rows/s here, minutes for a Criteo day), loading the cache at disk speed. The cache key is the
    file (path, size, modification time), ``vocab_size`` and ``max_rows``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no Criteo file at {path} (set data.path, or null to generate "
                                f"one)")
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{vocab_size}:{max_rows}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    cached = Path(cache_dir) / f"{path.name}.{digest}.pt"
    if cached.is_file():
        return CriteoData(**torch.load(cached, weights_only=True))  # a file beside user data
    data = read_criteo(path, vocab_size, max_rows)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    torch.save(dataclasses.asdict(data), tmp)
    os.replace(tmp, cached)
    return data


def get_batch(data: CriteoData, *, seed: int, step: int, global_batch_size: int, rank: int = 0,
              world_size: int = 1) -> CriteoData:
    """This rank's ``global_batch_size // world_size`` rows of the global batch of ``step``."""
    if global_batch_size % world_size:
        raise ValueError(f"data.global_batch_size={global_batch_size} must be divisible by the "
                         f"world size {world_size}")
    gen = torch.Generator().manual_seed(batch_seed(seed, step))
    index = torch.randint(0, len(data), (global_batch_size,), generator=gen)
    local = global_batch_size // world_size
    return data.rows(index[rank * local:(rank + 1) * local])
