"""The data dimension: replicas that average their gradients, and each rank's share of the data.

``DataParallel`` (``replicas.py``) wraps a model whose replicas train on the ranks that split the
batch; its gradients are averaged in buckets overlapped with backward (``grad_reducer.py``).
``shard_dataset`` / ``ShardSampler`` / ``ShardedIterable`` (``sharding.py``) give each of those
ranks its slice of a dataset.
"""

from parallel.data.replicas import DataParallel
from parallel.data.sharding import ShardedIterable, ShardSampler, shard_dataset

__all__ = ["DataParallel", "ShardSampler", "ShardedIterable", "shard_dataset"]
