"""The automatic-parallel cost model: α-β collective times, and a redistribution's modelled
collectives (kind and bytes per rank) equal to what DTensor issues for it on 2 and 4 ranks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import parallel
from comm_counter import collectives
from distributed import run_ranks
from parallel.auto.cost_model import (
    DEFAULT_PROFILES,
    Comm,
    DeviceProfile,
    local_shape,
    redistribution,
)

SHAPE = (8, 12)
CASES = {  # name -> (mesh shape, src, dst)
    "gather": ((2,), (Shard(0),), (Replicate(),)),
    "reduce": ((2,), (Partial(),), (Replicate(),)),
    "reduce_scatter": ((2,), (Partial(),), (Shard(1),)),
    "all_to_all": ((2,), (Shard(0),), (Shard(1),)),
    "slice": ((2,), (Replicate(),), (Shard(0),)),
    "2d": ((2, 2), (Shard(0), Partial()), (Replicate(), Replicate())),
    "2d_gather_inner": ((2, 2), (Replicate(), Shard(1)), (Replicate(), Replicate())),
}
_FUNCTIONAL = {"all_gather": "all_gather_into_tensor", "all_reduce": "all_reduce",
               "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}


def _measured(rank: int, world: int) -> dict[str, dict[str, list[int]]]:
    parallel.init()
    found = {}
    for name, (mesh_shape, src, dst) in CASES.items():
        if len(mesh_shape) == 2 and world != 4 or len(mesh_shape) == 1 and world != 2:
            continue
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape)
        tensor = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
        dt = distribute_tensor(tensor, mesh, [Replicate()] * len(mesh_shape))
        if any(isinstance(p, Partial) for p in src):  # the same slices, halves of the value
            dt = dt.redistribute(mesh, [Replicate() if isinstance(p, Partial) else p
                                        for p in src])
            dt = type(dt).from_local(dt.to_local() / 2, mesh, src, run_check=False)
        else:
            dt = dt.redistribute(mesh, src)
        found[name] = collectives(lambda dt=dt, mesh=mesh, dst=dst: dt.redistribute(mesh, dst)
                                  .to_local() + 0)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_modelled_redistributions_issue_what_dtensor_issues(world):
    measured = run_ranks(_measured, world)[0]
    for name, calls in measured.items():
        mesh_shape, src, dst = CASES[name]
        want: dict[str, list[int]] = {}
        for comm in redistribution(SHAPE, 4, mesh_shape, src, dst, kind="cpu"):
            want.setdefault(_FUNCTIONAL[comm.kind], []).append(comm.bytes // 4)
        assert calls == want, name


def test_alpha_beta_times_follow_the_ring_formulas():
    p = DeviceProfile("cpu", flops=1e9, alpha=1e-5, bandwidth=1e9, memory=1)
    assert Comm("all_reduce", 4, 1000).time(p) == pytest.approx(6e-5 + 1.5 * 1000 / 1e9)
    assert Comm("all_gather", 4, 1000).time(p) == pytest.approx(3e-5 + 3 * 1000 / 1e9)
    assert Comm("all_to_all", 2, 1000).time(p) == pytest.approx(1e-5 + 500 / 1e9)
    assert [c.kind for c in redistribution((8, 12), 4, (2,), (Shard(0),), (Shard(1),))] == [
        "all_to_all"]  # one all-to-all on an accelerator mesh
    assert Comm("all_reduce", 1, 10**9).time(p) == 0.0


def test_local_shapes_and_free_slices():
    assert local_shape((8, 12), (2, 4), (Shard(0), Shard(1))) == [4, 3]
    assert redistribution((8, 12), 4, (2,), (Replicate(),), (Shard(0),)) == []
    assert redistribution((8, 12), 4, (1,), (Shard(0),), (Replicate(),)) == []


def test_profiles_save_and_load(tmp_path):
    path = DEFAULT_PROFILES["cpu"].save(tmp_path / "profile.yaml")
    assert DeviceProfile.load(path) == DEFAULT_PROFILES["cpu"]
    path.write_text("flops: 1\n")
    with pytest.raises(ValueError, match="a device profile holds"):
        DeviceProfile.load(path)
    good = DEFAULT_PROFILES["cpu"].save(tmp_path / "good.yaml").read_text()
    for field, value, rule in (("memory", "-1", "must be > 0"), ("flops", "fast",
                               "must be a finite number"), ("alpha", "-1.0e-5", "must be >= 0"),
                               ("bandwidth", "0", "must be > 0")):
        lines = [f"{field}: {value}" if line.startswith(f"{field}:") else line
                 for line in good.splitlines()]
        path.write_text("\n".join(lines))
        with pytest.raises(ValueError, match=rf"profile.yaml: DeviceProfile.{field}=.* {rule}"):
            DeviceProfile.load(path)
    measured = dataclasses.replace(DEFAULT_PROFILES["cpu"], elementwise=(("gelu", 2e-9),),
                                   attention_flops=2e10, dispatch=1e-4, collective_call=4e-4)
    assert DeviceProfile.load(measured.save(tmp_path / "measured.yaml")) == measured
    # a profile saved before the measured terms loads without them
    path.write_text("kind: cpu\nflops: 1.0\nalpha: 1.0e-05\nbandwidth: 1.0e+09\nmemory: 1\n")
    assert DeviceProfile.load(path) == DeviceProfile("cpu", 1.0, 1e-5, 1e9, 1)


def test_profile_devices_measures_compute_and_saves_what_saved_profile_reads(tmp_path,
                                                                             monkeypatch):
    from parallel.auto.profile import saved_profile
    monkeypatch.setenv("HETERO_PARALLEL_CACHE", str(tmp_path))
    measured = parallel.auto.profile_devices(size=128, repeats=2, elements=2**12)
    assert measured.flops > 1e6 and measured.kind == "cpu"
    assert measured.attention_flops > 1e6 and measured.dispatch > 0
    assert {name for name, _ in measured.elementwise} >= {"gelu", "add", "layer_norm",
                                                          "softmax"}
    assert all(rate > 0 for _, rate in measured.elementwise)
    assert saved_profile() == measured


def test_the_profile_times_compute_in_the_dtype_jobs_compute_in(tmp_path, monkeypatch):
    """An accelerator's profile is timed in bf16 (fp16 without bf16), a host's in fp32: an
    H100's fp32 matmul runs at a fifteenth of its bf16 rate, and the plan prices bf16 jobs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallel.auto import profile as profiling
    assert profiling.compute_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setattr(profiling.hd, "supports_bf16", lambda: True)
    assert profiling.compute_dtype(torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(profiling.hd, "supports_bf16", lambda: False)
    assert profiling.compute_dtype(torch.device("cuda")) == torch.float16

    class Dtypes(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "gelu", "native_layer_norm"):
                self.seen.add(args[0].dtype if func.__name__.startswith("mm") else
                              args[-2].dtype if func.__name__.startswith("addmm") else
                              args[0].dtype)
            return func(*args, **(kwargs or {}))
    monkeypatch.setenv("HETERO_PARALLEL_CACHE", str(tmp_path))
    with Dtypes():
        measured = parallel.auto.profile_devices(size=64, repeats=1, elements=2**10,
                                                 dtype=torch.bfloat16)
    assert Dtypes.seen == {torch.bfloat16} and measured.flops > 0
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        parallel.auto.profile_devices(dtype=torch.int32)


def _profile_two_ranks(rank: int, world: int, path: str) -> DeviceProfile:
    parallel.init()
    return parallel.auto.profile_devices(f"{path}/rank{rank}.yaml", size=128, repeats=3,
                                         elements=2**12)


@pytest.mark.slow
def test_profile_devices_measures_the_links_of_a_process_group(tmp_path):
    profiles = run_ranks(_profile_two_ranks, 2, str(tmp_path))
    for profile in profiles:
        assert profile.alpha >= 0 and profile.bandwidth > 1e6  # gloo moves more than a MB/s
        assert profile.dispatch > 0 and profile.collective_call >= 0
    assert profiles[0] == profiles[1]  # one profile for the job: every rank plans alike


def test_collectives_add_their_measured_call_cost():
    p = DeviceProfile("cpu", flops=1e9, alpha=1e-5, bandwidth=1e9, memory=1)
    called = dataclasses.replace(p, collective_call=3e-4)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert Comm(kind, 4, 1000).time(called) == pytest.approx(Comm(kind, 4, 1000).time(p)
                                                                 + 3e-4)
    assert Comm("all_reduce", 1, 1000).time(called) == 0.0  # no group, no call


def _mlp_ops():
    from parallel.auto.graph import capture_ops

    mlp = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 64),
                              torch.nn.GELU(), torch.nn.Linear(64, 16))
    with torch.device("meta"):
        mlp = mlp.to("meta")
    return {op.target: op for op in capture_ops(mlp, (torch.empty(8, 4, 16, device="meta"),))}


def test_measured_elementwise_rates_price_by_element_and_dispatch_per_operator():
    """An operator the profile timed costs its elements x its measured seconds per element
    (forward and backward), split over the devices that divide them; one it did not keeps
    5 FLOPs per element and pass; every operator adds ``dispatch`` whatever its layout."""
    from parallel.auto.candidates import TRAINING_PASSES, candidates

    ops = _mlp_ops()
    assert {"gelu", "layer_norm", "linear"} <= set(ops)
    base = DeviceProfile("cpu", flops=1e9, alpha=1e-5, bandwidth=1e9, memory=1)
    measured = dataclasses.replace(base, elementwise=(("gelu", 2e-9),), dispatch=1e-4)
    gelu, norm = ops["gelu"], ops["layer_norm"]
    elements = math.prod(gelu.out_shape)
    for c in candidates(gelu, 4, measured, fully_use_devices=False):
        used = math.prod(c.inputs[0])
        assert c.compute == pytest.approx(elements * 2e-9 / used + 1e-4)
    whole = candidates(norm, 1, measured)[0]
    assert whole.compute == pytest.approx(
        TRAINING_PASSES * 5 * math.prod(norm.out_shape) / 1e9 + 1e-4)
    # the per-operator term is the same for every layout: it never changes a choice
    for op in ops.values():
        plain = [c.compute for c in candidates(op, 4, base)]
        added = [c.compute for c in candidates(op, 4, dataclasses.replace(base, dispatch=1e-4))]
        assert added == pytest.approx([x + 1e-4 for x in plain])


def test_attention_prices_at_its_measured_flops():
    from parallel.auto.candidates import TRAINING_PASSES, candidates
    from parallel.auto.graph import capture_ops

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    b, h, t, d = 2, 4, 16, 8
    q = torch.empty(b, h, t, d, device="meta")
    op = next(o for o in capture_ops(Attention(), (q, q, q)) if o.target ==
              "scaled_dot_product_attention")
    base = DeviceProfile("cpu", flops=1e10, alpha=1e-5, bandwidth=1e9, memory=1)
    fused = dataclasses.replace(base, attention_flops=2e9)
    work = TRAINING_PASSES * 2 * b * h * t * t * (d + d)
    assert candidates(op, 1, base)[0].compute == pytest.approx(work / 1e10)
    assert candidates(op, 1, fused)[0].compute == pytest.approx(work / 2e9)


def test_attention_compute_counts_its_two_products():
    """Attention is two contractions (query x key over the head size, weights x value over the
    keys): 2 x B x H x T x S x (D + E) FLOPs forward, three times that for a training step,
    not one product of all six sizes (16x too many at head size 32)."""
    from parallel.auto.candidates import TRAINING_PASSES, candidates
    from parallel.auto.graph import capture_ops

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    b, h, t, d = 4, 6, 64, 32
    q = torch.empty(b, h, t, d, device="meta")
    op = next(o for o in capture_ops(Attention(), (q, q, q))
              if o.rule.name == "scaled_dot_product_attention")
    profile = DEFAULT_PROFILES["cpu"]
    whole = next(c for c in candidates(op, 1, profile))
    assert whole.compute == pytest.approx(
        TRAINING_PASSES * 2 * b * h * t * t * (d + d) / profile.flops)


def test_plan_cost_counts_dispatch_per_operator_and_call_per_collective():
    """``dispatch`` adds the same to every plan (per operator, whatever the layout): the
    searches' choice does not move; ``collective_call`` adds to each collective of the plan."""
    from recipes.gpt import GPT

    with torch.device("meta"):
        model = GPT(65, 32, 2, 2, 16)
    idx = torch.zeros(4, 16, dtype=torch.long)
    base = DeviceProfile("cpu", flops=5e10, alpha=3e-5, bandwidth=5e9, memory=2**34)
    plans = {}
    for name, profile in {"base": base,
                          "dispatch": dataclasses.replace(base, dispatch=1e-3),
                          "call": dataclasses.replace(base, collective_call=1e-3)}.items():
        plans[name] = {mode: parallel.plan_auto_parallel(model, (idx,), device_num=4,
                                                         profile=profile, search_mode=mode)
                       for mode in ("dynamic_programming", "recursive_programming")}
    for mode, plan in plans["base"].items():
        shifted = plans["dispatch"][mode]
        assert shifted.by_op == plan.by_op
        assert shifted.cost == pytest.approx(plan.cost + 1e-3 * len(plan.ops))
        called = plans["call"][mode]
        comms = sum(len(op.comms) for op in called.ops)
        priced = parallel.plan_auto_parallel(model, (idx,), device_num=4, profile=base,
                                             strategies=called.strategies)
        assert called.cost == pytest.approx(priced.cost + 1e-3 * comms)
        assert comms <= sum(len(op.comms) for op in plan.ops)  # calls cost: no more of them
