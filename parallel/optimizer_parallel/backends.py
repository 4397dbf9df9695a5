"""Optimizer parallel's implementations, each declaring what it takes, and the one choice.

``ShardedDataParallel`` shards a model's optimizer state (level1), gradients (level2) and weights
(level3) over its data-parallel ranks with one of these backends:

* ``whole_weights`` (:mod:`.whole_weights`): level1/2 on a plain model whose gathers run
  chunkwise (gloo): whole weights between steps, ``Shard(0)`` slices for the optimizer,
  DDP-style buckets reduced by exchange, no FSDP2. On NCCL or HCCL level1/2 take FSDP2, whose
  units gather with prefetch and reduce-scatter on side streams (whole weights there would
  all-reduce every gradient: twice ZeRO-2's bytes);
* ``resharded`` (:mod:`.resharded`): level3 on a plain model whose gathers run chunkwise (gloo)
  and whose weights each own a storage that can be released between uses;
* ``fsdp2``: torch FSDP2 units (``fully_shard``), every level, under pipeline stages, semi-auto
  sharding, expert shards, 16-bit parameters and deferred initialization; at level2/3 with each
  rank's shards of weights and gradients at rest in host memory (``host_params``: FSDP2's
  ``CPUOffloadPolicy``, ZeRO-Infinity's ``offload_param``);
* ``placed``: FSDP2 units per module a ``hetero.place(mode="hooks")`` model placed, each on its
  device's mesh.

A *request* is the set of :data:`FEATURES` a model and its settings bring. :func:`choose` takes
the first backend (in :data:`BACKENDS`' order: the fastest first) whose declaration accepts the
request; a request no backend accepts is refused by name, with the declaration's reason, before
anything changes. ``parallel.combinations`` reads the same declarations
(:func:`unbuilt`), so the config refuses exactly what no backend takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

#: what a model and its settings may bring to optimizer parallel
FEATURES = ("semi_auto", "experts", "pipeline", "param_dtype", "deferred", "placed",
            "host_params")
LEVELS = frozenset({"level1", "level2", "level3"})


@dataclasses.dataclass(frozen=True)
class Facts:
    """What only the model and its mesh can say (asked only of a backend that needs it)."""

    gathers_chunkwise: Callable[[], bool]  # every group of the shard mesh is gloo's
    weights_releasable: Callable[[], bool]  # each sharded weight owns its storage alone


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation and what it takes: the levels, the :data:`FEATURES` it can run with
    (``takes``), the pairs of them it cannot run together (``not_together``: pair -> why), and
    a condition on the model (``holds``: None for none)."""

    name: str
    levels: frozenset[str]
    takes: frozenset[str]
    not_together: dict[frozenset[str], str] = dataclasses.field(default_factory=dict)
    holds: Callable[[Facts], bool] | None = None

    def conflict(self, request: frozenset[str]) -> str | None:
        """Why this backend cannot run ``request``'s features together (None: it can)."""
        return next((why for pair, why in self.not_together.items() if pair <= request), None)

    def accepts(self, level: str, request: frozenset[str]) -> bool:
        """Whether this backend takes ``request`` at ``level``, the model's facts aside."""
        return level in self.levels and request <= self.takes and self.conflict(request) is None


def _pair(a: str, b: str) -> frozenset[str]:
    return frozenset({a, b})


BACKENDS: tuple[Backend, ...] = (
    Backend("whole_weights", frozenset({"level1", "level2"}), frozenset(),
            holds=lambda facts: facts.gathers_chunkwise()),
    Backend("resharded", frozenset({"level3"}), frozenset(),
            holds=lambda facts: facts.gathers_chunkwise() and facts.weights_releasable()),
    Backend("fsdp2", LEVELS,
            frozenset({"semi_auto", "experts", "pipeline", "param_dtype", "deferred",
                       "host_params"}),
            not_together={
                **{_pair("host_params", other): f"weights on the host with {why} are not built "
                                                f"yet" for other, why in (
                    ("semi_auto", "semi-auto sharding"), ("experts", "expert shards"),
                    ("param_dtype", "param_dtype, whose host shards would be 16-bit"))},
                _pair("semi_auto", "experts"): "expert shards with semi-auto sharding are not "
                                               "built yet",
                _pair("semi_auto", "param_dtype"): "param_dtype with semi-auto sharding is not "
                                                   "built yet",
                _pair("experts", "param_dtype"): "expert shards with param_dtype are not built "
                                                 "yet"}),
    Backend("placed", LEVELS, frozenset({"placed"})),
)


def choose(level: str, request: Iterable[str], facts: Facts) -> Backend:
    """The first backend that takes ``request`` at ``level`` and whose condition ``facts``
    meet; ValueError naming why none does."""
    wanted = frozenset(request)
    unknown = wanted - set(FEATURES)
    if unknown:
        raise ValueError(f"optimizer parallel: unknown features {sorted(unknown)}; the "
                         f"features are {FEATURES}")
    for backend in BACKENDS:
        if backend.accepts(level, wanted) and (backend.holds is None or backend.holds(facts)):
            return backend
    raise ValueError(f"ShardedDataParallel: {_why_none(wanted)}")


def _why_none(wanted: frozenset[str]) -> str:
    """Why no backend takes ``wanted``: the rule of the backend that takes each of its
    features, or that no backend takes them all."""
    for backend in BACKENDS:
        why = backend.conflict(wanted) if wanted <= backend.takes else None
        if why is not None:
            return why
    if "placed" in wanted:
        others = sorted(wanted - {"placed"})
        return (f"a model placed by whole modules is sharded on its own: with {others} it is "
                f"not built yet")
    return f"{' × '.join(sorted(wanted))} together are not built yet"


def unbuilt(request: Iterable[str]) -> str | None:
    """Why no backend takes ``request`` at any level (None: one does, the model's facts
    aside): what ``parallel.combinations`` refuses in a config."""
    wanted = frozenset(request)
    if any(b.accepts(level, wanted) for b in BACKENDS for level in b.levels):
        return None
    return _why_none(wanted)
