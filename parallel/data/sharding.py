"""Dataset sharding for data parallel: ``num_shards`` / ``shard_id`` with cyclic refill.

The reference's rule: split the dataset by sample, give each device its shard, and when a shard
runs short, sample again from the beginning, so every rank sees the same number of samples and
no rank waits at a collective for a batch that never comes. For map-style datasets torch's
``DistributedSampler`` already implements exactly that (padding from the start, per-epoch
shuffling with ``set_epoch``), so :class:`ShardSampler` is it with the defaults taken from the
world and the reference's argument names and errors. Iterable datasets have no sampler, so
:class:`ShardedIterable` deals items round-robin and refills the short shards from the stream's
first items.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Subset

from parallel.comm import get_rank, get_world_size, is_initialized


def _resolve(num_shards: int | None, shard_id: int | None) -> tuple[int, int]:
    if num_shards is None:
        num_shards = get_world_size() if is_initialized() else 1
    if shard_id is None:
        shard_id = get_rank() if is_initialized() else 0
    for name, value in (("num_shards", num_shards), ("shard_id", shard_id)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id must be in [0, num_shards={num_shards}), got {shard_id}")
    return num_shards, shard_id


class ShardSampler(DistributedSampler):
    """Indices of shard ``shard_id`` of ``num_shards`` (default: this rank of the world).

    Every shard has ``ceil(len(dataset) / num_shards)`` indices; short shards restart from the
    beginning. ``shuffle`` reshuffles per epoch (call ``set_epoch``) with the same permutation on
    every rank, so shards stay disjoint.
    """

    def __init__(self, dataset: Dataset, num_shards: int | None = None,
                 shard_id: int | None = None, *, shuffle: bool = False, seed: int = 0) -> None:
        num_shards, shard_id = _resolve(num_shards, shard_id)
        if len(dataset) == 0:  # type: ignore[arg-type]  # a map-style dataset has a length
            raise ValueError("cannot shard an empty dataset")
        super().__init__(dataset, num_replicas=num_shards, rank=shard_id, shuffle=shuffle,
                         seed=seed, drop_last=False)


class ShardedIterable(IterableDataset):
    """Shard ``shard_id`` of an iterable dataset: items ``shard_id, shard_id + n, ...``.

    When the stream ends mid-round, the shards left without an item take one from the stream's
    beginning, so all shards yield the same count. ``set_epoch`` is passed to the wrapped dataset
    when it has one.
    """

    def __init__(self, dataset: IterableDataset, num_shards: int, shard_id: int) -> None:
        self.dataset, self.num_shards, self.shard_id = dataset, num_shards, shard_id

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        head: list[Any] = []  # the first round, kept to refill a short last round
        count = 0
        for item in self.dataset:
            if count < self.num_shards:
                head.append(item)
            if count % self.num_shards == self.shard_id:
                yield item
            count += 1
        short_from = count % self.num_shards  # shards >= this got one item fewer
        if count and short_from and self.shard_id >= short_from:
            yield head[(self.shard_id - short_from) % len(head)]


def shard_dataset(dataset: Dataset | IterableDataset, num_shards: int | None = None,
                  shard_id: int | None = None) -> Dataset | IterableDataset:
    """This shard of ``dataset`` (defaults: the world's size and this rank), in order.

    Map-style datasets become a ``Subset`` over :class:`ShardSampler`'s indices; iterable ones a
    :class:`ShardedIterable`. For per-epoch shuffling use ``ShardSampler(shuffle=True)`` with a
    ``DataLoader`` instead.
    """
    num_shards, shard_id = _resolve(num_shards, shard_id)
    if isinstance(dataset, IterableDataset):
        return ShardedIterable(dataset, num_shards, shard_id)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"shard_dataset needs a map-style (len + getitem) or an IterableDataset, got "
            f"{type(dataset).__name__}"
        )
    return Subset(dataset, list(ShardSampler(dataset, num_shards, shard_id)))
