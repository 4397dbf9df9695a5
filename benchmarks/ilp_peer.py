"""The peer of our strategy searches: the same cost model solved as an integer linear program
(PuLP + CBC, ``pip install -e .[bench]``), the formulation Alpa and meta-pytorch/autoparallel use
(the latter does not install here: it is not released on PyPI).

One binary per (operator, candidate), exactly one per operator. An edge's redistribution cost is
linear in a product of two choices; instead of one variable per candidate pair (candidates squared
per edge), the choices are first summed per distinct layout on each side (the producer's output
and partial factor, the consumer's input split: far fewer than candidates), and one continuous
``y >= out + need - 1`` per layout pair carries the cost (exact, as every cost is non-negative
and minimised). A parameter shared by two operators must take the same layout on both. The memory
limit, when given, is one linear constraint (no relaxation needed).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import pulp

from parallel.auto.candidates import Candidate, annotated_candidate
from parallel.auto.cost_model import DeviceProfile
from parallel.auto.graph import OpNode
from parallel.auto.propagate import PricedGraph


def _edges_and_ties(problem: pulp.LpProblem, prices: PricedGraph, ops: list[OpNode],
                    x: list[list[pulp.LpVariable]]) -> list:
    """The redistribution terms of the objective (one variable per priced pair of layouts on an
    edge, a pair DTensor would not give forbidden) and a tied parameter's one layout."""
    objective = []

    def grouped(j: int, key) -> dict:
        groups = defaultdict(list)
        for i, c in enumerate(prices.options[j]):
            groups[key(c)].append(x[j][i])
        return {layout: pulp.lpSum(vs) for layout, vs in groups.items()}

    for j, op in enumerate(ops):
        for k, src in enumerate(op.sources):
            if not src.linked:
                continue
            outs = grouped(src.op, lambda c: c.made)
            needs = grouped(j, lambda c, k=k: c.inputs[k])
            for a, (layout, out) in enumerate(outs.items()):
                for b, (need, chosen) in enumerate(needs.items()):
                    cost = prices.edge(j, k, layout, need)
                    if cost == math.inf:  # a layout DTensor would not give: never both
                        problem += out + chosen <= 1
                    elif cost > 0:
                        y = problem.add_variable(f"y_{j}_{k}_{a}_{b}", lowBound=0)
                        problem += y >= out + chosen - 1
                        objective.append(cost * y)
    for pairs in prices.tied.values():
        (a, ka), rest = pairs[0], pairs[1:]
        first = grouped(a, lambda c, ka=ka: c.inputs[ka])
        for b, kb in rest:
            other = grouped(b, lambda c, kb=kb: c.inputs[kb])
            for layout in first.keys() | other.keys():
                problem += first.get(layout, 0) == other.get(layout, 0)
    return objective


def ilp_search(ops: list[OpNode], device_num: int, profile: DeviceProfile, *,
               max_device_memory: float | None = None, time_limit: float = 60.0
               ) -> tuple[list[Candidate], float, str]:
    """The chosen candidate per operator, the solver's seconds, and its status ("Optimal", or
    "Not Solved" / "Not optimal (time limit)" when the limit stopped it)."""
    prices = PricedGraph(ops, device_num, profile)
    for j, op in enumerate(ops):
        if op.annotated is not None:
            prices.options[j] = [annotated_candidate(op, profile)]
    problem = pulp.LpProblem("strategy", pulp.LpMinimize)
    x = [[problem.add_variable(f"x_{j}_{c}", cat="Binary") for c in range(len(options))]
         for j, options in enumerate(prices.options)]
    objective = []
    for j, options in enumerate(prices.options):
        problem += pulp.lpSum(x[j]) == 1
        objective += [(prices.own(j, c) + c.compute) * x[j][i] for i, c in enumerate(options)]

    objective += _edges_and_ties(problem, prices, ops, x)
    if max_device_memory is not None:
        problem += pulp.lpSum(c.memory * x[j][i] for j, options in enumerate(prices.options)
                              for i, c in enumerate(options)) <= max_device_memory
    problem += pulp.lpSum(objective)
    start = time.perf_counter()
    problem.solve(pulp.COIN_CMD(msg=False, timeLimit=time_limit))  # CBC from pulp[cbc]
    seconds = time.perf_counter() - start
    status = pulp.LpStatus[problem.status]
    if status == "Optimal" and seconds >= time_limit:
        status = "Not optimal (time limit)"
    chosen = [options[max(range(len(options)), key=lambda i, j=j: x[j][i].value() or 0)]
              for j, options in enumerate(prices.options)]
    return chosen, seconds, status


def total_cost(ops: list[OpNode], device_num: int, profile: DeviceProfile,
               chosen: list[Candidate]) -> float:
    """The cost model's time of one candidate per operator (the searches' objective)."""
    return PricedGraph(ops, device_num, profile).total(chosen)
