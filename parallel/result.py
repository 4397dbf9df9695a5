"""``Parallelized``: what ``parallel.parallelize(model, config)`` returns.

Everything the call made, handed back explicitly rather than kept in module-level registries:
the module to train (``model``), the resolved config and the ``ParallelDims`` whose meshes it
used, the searched plan, and ``explain()``, one account of all of it. It is not the model (the
previous release let it stand in for one, with a warning): train ``result.model``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from foundation.model_view import unwrapped
from parallel.auto.plan import StrategyPlan
from parallel.config import ParallelConfig
from parallel.dims import ParallelDims


@dataclasses.dataclass
class Parallelized:
    """The parallelised model and how it was made (see the module docstring).

    model: what to train — the model sharded in place, or the wrapper a mode puts around it
        (``DataParallel``, ``ShardedDataParallel``, ``Pipeline``, ``MultiCopy``).
    config: the resolved ``ParallelConfig`` (``data_degree`` filled in).
    dims: the ``ParallelDims`` every mode took its process groups from.
    plan: the ``StrategyPlan`` a search applied (None without a ``search_mode``, or when the
        plan was given as a saved file or mapping).
    module (a property): the model as built, under every wrapper (``unwrapped``).
    """

    model: nn.Module
    config: ParallelConfig
    dims: ParallelDims
    plan: StrategyPlan | None = None
    #: what ``explain()`` prints after the mesh, one callable per mode that made a part of the
    #: result (given by ``parallelize``, which knows the modes; this module stays below them)
    accounts: list[Callable[[], str]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def module(self) -> nn.Module:
        """The model as you built it (this rank's part of it under pipeline stages), whatever
        wraps it: the same kind of object for every mode and world size, where ``model`` is a
        data-parallel wrapper on several ranks and the placed model or the model itself on
        one. ``hetero.explain(result.model)`` finds the placement the same way."""
        return unwrapped(self.model)[-1]

    def explain(self) -> str:
        """The mesh, then each mode's own account: pipeline stages, sharding layouts, the
        auto-parallel plan, the optimizer shards."""
        return "\n".join(self.explain_parts())

    def explain_parts(self) -> list[str]:
        """:meth:`explain`'s parts, one string each: the mesh, then each mode's account."""
        return [self.dims.describe(), *(account() for account in self.accounts)]
