"""Modules for heterogeneous models: ``EmbeddingLookup``, a table on the host or the accelerator.

    emb = hetero.nn.EmbeddingLookup(10_000_000, 64, target="CPU")   # 2.5 GB stays in host memory
    model = WideDeep(emb, ...).to(device)    # the table stays on the host; its rows come here
    opt = hetero.optim.LazyAdam(emb.parameters(), lr=1e-3)    # row-sparse update, on the host
"""

from hetero.nn.embedding_lookup import EmbeddingLookup

__all__ = ["EmbeddingLookup"]
