"""Which modules become FSDP2 units, and which parameters stay replicated.

A unit is what one all-gather / reduce-scatter covers: a layer of the outermost layer stacks
(:func:`foundation.layers.unit_modules`), so one layer's weights are gathered while the previous
layer computes and one layer's gradients are reduce-scattered while backward goes on; what is
left (embeddings, final norm, head) belongs to the root unit.

Parameters smaller than the threshold (``parallel_optimizer_threshold`` KB, MindSpore's rule:
sharding a bias costs a collective's latency to save a few bytes) and the tables of modules with
row-sparse gradients (``sparse=True``: a reduce-scatter needs dense gradients) stay replicated;
the caller all-reduces their gradients. So do parameters reachable from more than one FSDP2 root
(several pipeline stages on one rank, each its own root, sharing a tied weight): FSDP2 lets a
single root own a parameter.
"""

from __future__ import annotations

from torch import nn

from foundation.layers import unit_modules as unit_modules  # the units' walk, shared
from hetero.nn.row_blocks import reduces_itself


def shared_params(roots: list[nn.Module]) -> frozenset[int]:
    """Ids of the parameters reachable from more than one of ``roots``."""
    seen: set[int] = set()
    shared: set[int] = set()
    for root in roots:
        mine = {id(p) for p in root.parameters()}
        shared |= mine & seen
        seen |= mine
    return frozenset(shared)


def replicated_params(model: nn.Module, threshold_kb: int, shared: frozenset[int] = frozenset()
                      ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(replicated, sparse): the parameters that are not sharded — under ``threshold_kb`` KB, of
    a ``sparse=True`` module (these also in ``sparse``), or with their id in ``shared``
    (``shared_params``), in model order. A row-sharded table's block is in neither: its rows
    are spread over the ranks already and its gradients were pushed to their owners."""
    sparse = {id(p) for m in model.modules() if getattr(m, "sparse", False) is True
              for p in m.parameters(recurse=False)}
    params = [p for p in model.parameters() if not reduces_itself(p)]
    replicated = [p for p in params
                  if id(p) in sparse or id(p) in shared
                  or p.numel() * p.element_size() < threshold_kb * 1024]
    return replicated, [p for p in replicated if id(p) in sparse]


def row_sharded_params(model: nn.Module) -> list[nn.Parameter]:
    """The blocks of row-sharded tables (``hetero.nn.EmbeddingLookup(sharding="row")``) and
    their caches' rows: they exchange and sum their own gradients."""
    return [p for p in model.parameters() if reduces_itself(p)]
