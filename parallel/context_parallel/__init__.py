"""Context parallel: the sequence dimension of every activation split over ``context_degree``
ranks, attention computed over the whole sequence by ring attention (pass-KV, balanced causal
chunks) or Ulysses (all-to-all between heads and sequence).

``layout`` says which tokens a rank holds, ``blocks`` and ``ring`` compute ring attention,
``ulysses`` the all-to-all variant, ``wrapper`` runs a model on its share of the sequence.
"""

from parallel.context_parallel.layout import positions, shard_sequence
from parallel.context_parallel.ring import ring_attention
from parallel.context_parallel.ulysses import ulysses_attention
from parallel.context_parallel.wrapper import ContextParallel, context_parallel

__all__ = ["ContextParallel", "context_parallel", "positions", "ring_attention",
           "shard_sequence", "ulysses_attention"]
