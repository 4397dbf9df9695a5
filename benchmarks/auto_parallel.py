"""Auto parallel (sharding propagation): planning time, and the planned strategy's training step
against the hand-written Megatron strategy and against DTensor's own propagation.

``plan`` (one process, no process group): GPT graphs of 12, 48 and 96 layers (d_model 1024,
16 heads, batch 1024 × 512 tokens, built on the meta device: no memory) planned for 8, 64 and
1024 devices: by propagation from one annotation (every MLP's first Linear column parallel over
8 devices, batch parallel over the rest; goal < 50 ms per 1000 operators), and by both searches
from none (goals: dynamic programming < 10 s for 96 layers on 64 devices, recursive < 1 s on
1024). Prints capture (torch.export on fake tensors) and search times, and the modelled step
time against the hand-written Megatron × data-parallel plan's; and on the smaller graphs the peer,
the same cost model as an integer linear program (``benchmarks/ilp_peer.py``: PuLP + CBC, the
formulation of Alpa and meta-pytorch/autoparallel; ``pip install -e .[bench]``), its solve time
and cost (time limit ``BENCH_ILP_SECONDS``, default 300).

``step`` (torchrun, 2 or 4 ranks): the recipe GPT (d_model 192, 4 layers, batch 16 × 64) under
strategies that hold the same parameters, forward + backward, median of ``BENCH_ROUNDS``
rounds (default 3, every strategy in turn, so other processes' load falls on all alike) of the
median of ``BENCH_STEPS``: the
hand-written ``conf/strategy/gpt_megatron.yaml``; auto parallel from the two lines of
``conf/strategy/gpt_mlp_columns.yaml``; those two lines alone as semi-auto, every other operator
left to DTensor's own (per-operator) propagation; and both searches with no annotation. Prints
step time, the ratio to the hand-written one (median of the rounds' ratios; goal: ≤ 1.05×), the
collectives per step (count and MB, profiler) and the cost model's step for the plan on the
profile ``profile_devices()`` measures at the start of each round (goal: within ±30% of the
measured step; the searches plan on the first round's), and its ratio on the first profile
alone.

    python benchmarks/auto_parallel.py plan
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/auto_parallel.py step
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ilp_peer import ilp_search, total_cost  # noqa: E402
from timing import median_ms  # noqa: E402

import parallel  # noqa: E402
from parallel.auto.cost_model import DEFAULT_PROFILES, DeviceProfile  # noqa: E402
from parallel.auto.graph import capture_ops  # noqa: E402
from parallel.semi_auto import load_strategy_file  # noqa: E402
from recipes.gpt import GPT  # noqa: E402
from recipes.parallel_mode import STRATEGY_DIR  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", 10))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
#: graphs the ILP peer is given (larger ones only show the solver hitting its time limit)
ILP_CASES = {(12, 8), (12, 64), (48, 8)}
ILP_TIME_LIMIT = float(os.environ.get("BENCH_ILP_SECONDS", 300))


def plan_times() -> None:
    """Propagation from one annotation, both searches from none, and the hand-written Megatron
    × data-parallel plan as the baseline of modelled step time (accelerator profile)."""
    print(f"{'layers':>6} {'devices':>8} {'operators':>10} {'capture s':>10} {'search':>22} "
          f"{'search ms':>10} {'ms/1000 ops':>12} {'modelled s':>11} {'vs Megatron':>12}")
    profile = DEFAULT_PROFILES["device"]
    for layers in (12, 48, 96):
        with torch.device("meta"):
            model = GPT(65, 1024, layers, 16, 512)
        idx = torch.randint(0, 65, (1024, 512))
        for devices in (8, 64, 1024):
            mp = min(devices, 8)
            megatron = load_strategy_file(STRATEGY_DIR / "gpt_megatron.yaml", dp=devices // mp,
                                          mp=mp)
            base = parallel.plan_auto_parallel(model, (idx,), device_num=devices,
                                               profile=profile, strategies=megatron)
            runs = [("propagation (1 annotation)", "sharding_propagation",
                     {"blocks.*.mlp.0": ((devices // mp, 1, 1), (mp, 1))}),
                    ("recursive programming", "recursive_programming", None)]
            if devices <= 64:  # the DP's elimination tensors grow as candidates cubed
                runs.insert(1, ("dynamic programming", "dynamic_programming", None))
            for name, mode, strategies in runs:
                plan = parallel.plan_auto_parallel(model, (idx,), device_num=devices,
                                                   profile=profile, search_mode=mode,
                                                   strategies=strategies)
                ms = plan.seconds["search"] * 1e3
                print(f"{layers:>6} {devices:>8} {len(plan.ops):>10} "
                      f"{plan.seconds['capture']:>10.2f} {name:>22} {ms:>10.1f} "
                      f"{ms / len(plan.ops) * 1000:>12.1f} {plan.cost:>11.3f} "
                      f"{plan.cost / base.cost:>11.2f}×")
            if (layers, devices) in ILP_CASES:
                ops = capture_ops(model, (idx,))
                chosen, seconds, status = ilp_search(ops, devices, profile,
                                                     time_limit=ILP_TIME_LIMIT)
                cost = total_cost(ops, devices, profile, chosen)
                print(f"{layers:>6} {devices:>8} {len(ops):>10} {'':>10} "
                      f"{'ILP (PuLP + CBC)':>22} {seconds * 1e3:>10.1f} "
                      f"{seconds * 1e6 / len(ops):>12.1f} {cost:>11.3f} "
                      f"{cost / base.cost:>11.2f}×  {status}")


def _collectives(fn) -> tuple[int, float]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    calls = [e for e in prof.events() if e.name.startswith("_c10d_functional::")
             and e.name.split("::")[1] not in ("wait_tensor", "_wrap_tensor_autograd")]
    return len(calls), sum(math.prod(e.input_shapes[0]) * 4 for e in calls) / 2**20


def _modelled(model, strategies, idx, world, profile) -> float:
    """The cost model's step (forward + backward, every collective) of ``strategies``."""
    return parallel.plan_auto_parallel(model, (idx,), device_num=world, profile=profile,
                                       strategies=strategies).cost * 1e3


def step_times() -> None:
    parallel.init()
    world = parallel.get_world_size()
    idx = torch.randint(0, 65, (16, 64), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 65, (16, 64), generator=torch.Generator().manual_seed(1))
    annotations = load_strategy_file(STRATEGY_DIR / "gpt_mlp_columns.yaml", dp=1, mp=world)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"profile-{parallel.get_rank()}.yaml"

    def measure() -> DeviceProfile:
        # links measured at the step's message sizes (its largest all-reduces are 0.4-1.5 MB)
        return parallel.auto.profile_devices(path, link_bytes=(4096, 2**20))
    measured = measure()
    names = ("hand-written Megatron", "auto (2 annotation lines)",
             "DTensor propagation (same 2 lines)", "dynamic programming (none)",
             "recursive programming (none)")
    with torch.device("meta"):
        twin = GPT(65, 192, 4, 6, 64)  # what the cost model prices, on no memory
    steps, priced = [], []  # priced: the strategies the cost model prices (None: not a plan)
    for name in names:
        torch.manual_seed(0)
        model = GPT(65, 192, 4, 6, 64)
        if name.startswith("hand"):
            strategies = load_strategy_file(STRATEGY_DIR / "gpt_megatron.yaml", dp=1, mp=world)
            priced.append(strategies)
            parallel.parallelize(model, parallel.ParallelConfig(strategies=strategies))
        elif name.startswith("auto"):
            priced.append(annotations)
            parallel.parallelize(model, parallel.ParallelConfig(search_mode="sharding_propagation",
                                                       strategies=annotations),
                                 example_inputs=(idx,))
        elif name.startswith(("dynamic", "recursive")):
            mode = "dynamic_programming" if name.startswith("dynamic") else "recursive_programming"
            plan = parallel.plan_auto_parallel(model, (idx,), device_num=world,
                                               search_mode=mode, profile=measured)
            priced.append(plan.strategies)  # priced again from them: the same plan and cost
            parallel.parallelize(model, parallel.ParallelConfig(search_mode=mode), plan=plan)
        else:
            priced.append(None)  # DTensor's own choices: not a plan the model prices
            parallel.parallelize(model, parallel.ParallelConfig(strategies=annotations))

        def step(model=model) -> None:
            model(idx, targets)[1].backward()
            model.zero_grad(set_to_none=True)
        steps.append(step)

    def modelled(profile: DeviceProfile) -> list[float]:
        return [math.nan if s is None else _modelled(twin, s, idx, world, profile)
                for s in priced]
    at_start = modelled(measured)
    # rounds over every strategy in turn, so load from other processes falls on all alike;
    # each round measures the profile again and prices every plan on it (the searches' plans
    # stay those of the first profile): the model against the step under the same load
    rounds, models = [], []
    for i in range(ROUNDS):
        models.append(at_start if i == 0 else modelled(measure()))
        rounds.append([median_ms(step, STEPS) for step in steps])
    ms = [statistics.median(r[i] for r in rounds) for i in range(len(steps))]
    ratios = [statistics.median(r[i] / r[0] for r in rounds) for i in range(len(steps))]
    model_ms = [statistics.median(m[i] for m in models) for i in range(len(steps))]
    fits = [statistics.median(m[i] / r[i] for m, r in zip(models, rounds, strict=True))
            for i in range(len(steps))]
    comms = [_collectives(step) for step in steps]
    if parallel.get_rank() == 0:
        print(f"GPT (d_model 192, 4 layers, batch 16 × 64) forward + backward on {world} "
              f"gloo ranks, median of {ROUNDS} rounds × {STEPS} steps; modelled on each "
              f"round's profile (and on the first profile alone)")
        print(f"{'strategy':<36}{'ms/step':>9}{'vs hand':>9}{'collectives':>13}{'MB':>8}"
              f"{'modelled ms':>13}{'model/measured':>16}{'first profile':>15}")
        for name, t, ratio, (count, mb), model, fit, first in zip(
                names, ms, ratios, comms, model_ms, fits, at_start, strict=True):
            print(f"{name:<36}{t:>9.1f}{ratio:>8.2f}×{count:>13}{mb:>8.2f}"
                  f"{model:>13.1f}{fit:>15.2f}×{first / t:>14.2f}×")
    parallel.destroy()


if __name__ == "__main__":
    if sys.argv[1:] == ["plan"]:
        plan_times()
    elif sys.argv[1:] == ["step"]:
        step_times()
    else:
        raise SystemExit("usage: python benchmarks/auto_parallel.py plan|step")
