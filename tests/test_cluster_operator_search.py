"""The per-operator searches priced on a two-level cluster (``plan_auto_parallel(...,
cluster=)``): collectives by where their ranks sit, so tensor-sharded groups stay inside a
node when the links between nodes are slow; and ``plan_cluster``'s per-operator strategies come
from that search."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallel
from parallel.auto import ClusterSpec
from parallel.auto.cluster_planner import plan_cluster
from parallel.auto.cost_model import Comm, DeviceProfile
from recipes.gpt import GPT

#: two nodes of four devices, the network 100x slower than the links inside a node
SLOW_NETWORK = ClusterSpec(nodes=2, devices_per_node=4, flops={"float32": 1e13},
                           memory=80 * 2**30, intra_bandwidth=1e11, inter_bandwidth=1e9,
                           intra_latency=1e-6, inter_latency=1e-5, matmul_efficiency=1.0,
                           name="slow-network")
#: the same devices on one flat network at the intra-node speed
FLAT = DeviceProfile("flat", flops=1e13, alpha=1e-6, bandwidth=1e11, memory=80 * 2**30)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)), \
            torch.empty(64, 64, 1024)


def test_a_collective_is_priced_by_the_nodes_its_ranks_sit_in():
    profile = SLOW_NETWORK.device_profile(torch.float32)
    inside = Comm("all_reduce", 4, 2**20, axes=((4, 1),))  # ranks 0-3: one node
    across = Comm("all_reduce", 2, 2**20, axes=((2, 4),))  # ranks 0 and 4: two nodes
    spanning = Comm("all_reduce", 8, 2**20, axes=((8, 1),))
    assert inside.time(profile) == pytest.approx(
        SLOW_NETWORK.all_reduce(2**20, SLOW_NETWORK.group(4, 1)))
    assert SLOW_NETWORK.placed(2, ((2, 4),)).nodes == 2
    assert across.time(profile) == pytest.approx(
        SLOW_NETWORK.all_reduce(2**20, SLOW_NETWORK.group(2, 4)))
    assert across.time(profile) > 10 * Comm("all_reduce", 2, 2**20, axes=((2, 1),)).time(profile)
    assert SLOW_NETWORK.placed(8, ((2, 4), (4, 1))).per_node == 4  # hierarchical
    assert spanning.time(profile) > inside.time(profile)


@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming"])
def test_the_search_keeps_tensor_groups_inside_a_node(mode):
    model, x = _mlp()
    flat = parallel.plan_auto_parallel(model, (x,), device_num=8, search_mode=mode,
                                       profile=FLAT)
    topo = parallel.plan_auto_parallel(model, (x,), device_num=8, search_mode=mode,
                                       cluster=SLOW_NETWORK)

    def groups(plan):
        return [SLOW_NETWORK.placed(c.group, c.axes) for op in plan.ops for c in op.comms]
    # on a flat machine the MLP is split 8 ways and its partial sums reduced across nodes
    assert any(g.nodes > 1 for g in groups(flat))
    # priced on the cluster, some operator is still tensor-sharded, every group in one node
    assert groups(topo) and all(g.nodes == 1 for g in groups(topo))
    assert any(max(max(entry) for entry in s) > 1 for s in topo.strategies.values())
    # and it is cheaper on that cluster than the flat plan
    replay = parallel.plan_auto_parallel(model, (x,), device_num=8, cluster=SLOW_NETWORK,
                                         strategies=flat.strategies)
    assert topo.cost < replay.cost


def test_a_cluster_replaces_the_profile_and_bounds_the_devices():
    model, x = _mlp()
    with pytest.raises(ValueError, match="profile or a cluster"):
        parallel.plan_auto_parallel(model, (x,), device_num=8, profile=FLAT,
                                    cluster=SLOW_NETWORK)
    with pytest.raises(ValueError, match="exceeds the cluster's 8 devices"):
        parallel.plan_auto_parallel(model, (x,), device_num=16, cluster=SLOW_NETWORK,
                                    search_mode="recursive_programming")


def _meta_gpt(layers: int = 4):
    """Wide enough that the cluster planner splits it over a node's devices."""
    with torch.device("meta"):
        return GPT(8192, 8192, layers, 64, block_size=1024)


@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming"])
def test_plan_cluster_takes_its_operator_strategies_from_the_topology_priced_search(mode):
    cluster = ClusterSpec.preset("a100-80gb", nodes=2)
    example = (torch.zeros(1, 1024, dtype=torch.long, device="meta"),)
    plan = plan_cluster(_meta_gpt(), example, cluster=cluster, global_batch=32,
                        operator_search=mode)
    assert plan.tensor > 1 and plan.data > 1
    ops = plan.operators
    assert ops.device_num == plan.tensor and ops.search_mode == mode
    assert ops.profile.cluster is cluster
    want = parallel.plan_auto_parallel(
        _meta_gpt(), (torch.zeros(plan.micro_batch_size, 1024, dtype=torch.long),),
        device_num=plan.tensor, search_mode=mode, cluster=cluster, dtype=torch.bfloat16)
    assert ops.strategies == want.strategies
    assert all(cluster.placed(c.group, c.axes).nodes == 1 for op in ops.ops for c in op.comms)
    # the job's strategies split each batch over the data ranks as well
    for key, (first, *rest) in plan.strategies.items():
        assert first[0] == ops.strategies[key][0][0] * plan.data
        assert tuple(rest) == ops.strategies[key][1:]
    assert plan.to_config().strategies == plan.strategies
    assert "per-operator strategies: " + mode in plan.explain()


def test_the_operator_search_can_be_skipped_and_bad_modes_are_named():
    cluster = ClusterSpec.preset("a100-80gb", nodes=2)
    example = (torch.zeros(1, 1024, dtype=torch.long, device="meta"),)
    plan = plan_cluster(_meta_gpt(), example, cluster=cluster, global_batch=32,
                        operator_search=None)
    assert plan.operators is None and plan.strategies == {}
    with pytest.raises(ValueError, match="needs the per-operator strategies"):
        plan.to_config()
    with pytest.raises(ValueError, match="operator_search 'ilp' is not one of"):
        plan_cluster(_meta_gpt(), example, cluster=cluster, global_batch=8,
                     operator_search="ilp")
