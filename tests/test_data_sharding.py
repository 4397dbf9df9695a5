"""shard_dataset / ShardSampler / ShardedIterable: the reference's num_shards/shard_id rules."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import parallel


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize(("n", "shards"), [(10, 4), (8, 4), (3, 4), (1, 3), (2, 5), (7, 1)])
def test_shards_are_equal_sized_and_refill_cyclically_from_the_start(n, shards):
    data = list(range(n))
    parts = [list(parallel.shard_dataset(data, shards, s)) for s in range(shards)]
    per_shard = -(-n // shards)
    assert all(len(p) == per_shard for p in parts)
    flat = [x for round_ in zip(*parts, strict=True) for x in round_]
    assert flat[:n] == data  # every sample once, dealt round-robin
    assert flat[n:] == [data[i % n] for i in range(len(flat) - n)]  # refill from the beginning
    streams = [list(parallel.shard_dataset(Stream(n), shards, s)) for s in range(shards)]
    assert streams == parts  # iterable datasets follow the same rule


def test_sampler_reshuffles_per_epoch_and_keeps_shards_disjoint():
    data = list(range(20))
    samplers = [parallel.data.ShardSampler(data, 2, s, shuffle=True, seed=7)
                for s in range(2)]
    epochs = []
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        shards = [list(s) for s in samplers]
        assert sorted(shards[0] + shards[1]) == data
        epochs.append(shards[0])
    assert epochs[0] != epochs[1] != epochs[2]
    again = parallel.data.ShardSampler(data, 2, 0, shuffle=True, seed=7)
    again.set_epoch(1)
    assert list(again) == epochs[1]  # deterministic per (seed, epoch)


def test_sampler_feeds_a_dataloader():
    data = TensorDataset(torch.arange(10.0))
    loader = DataLoader(data, batch_size=2, sampler=parallel.data.ShardSampler(data, 2, 1))
    assert [b[0].tolist() for b in loader] == [[1.0, 3.0], [5.0, 7.0], [9.0]]


def test_defaults_come_from_the_world():
    parallel.init()
    assert list(parallel.shard_dataset(list(range(5)))) == [0, 1, 2, 3, 4]  # 1 rank: everything
    assert parallel.data.ShardSampler(list(range(5))).num_replicas == 1


@pytest.mark.parametrize(
    ("num_shards", "shard_id", "error", "message"),
    [(0, 0, ValueError, "num_shards must be at least 1"),
     (2, 2, ValueError, r"shard_id must be in \[0, num_shards=2\), got 2"),
     (2, -1, ValueError, "shard_id must be in"),
     (2.0, 0, TypeError, "num_shards must be an int"),
     (2, "1", TypeError, "shard_id must be an int")],
)
def test_bad_shards(num_shards, shard_id, error, message):
    with pytest.raises(error, match=message):
        parallel.shard_dataset(list(range(4)), num_shards, shard_id)
    with pytest.raises(error, match=message):
        parallel.data.ShardSampler(list(range(4)), num_shards, shard_id)


def test_empty_and_unshardable_datasets():
    with pytest.raises(ValueError, match="empty dataset"):
        parallel.shard_dataset([], 2, 0)
    with pytest.raises(TypeError, match="map-style"):
        parallel.shard_dataset(42, 2, 0)
