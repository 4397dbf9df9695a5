"""Training step of a ~1B-parameter GPT: OffloadAdamW vs all-on-GPU fused AdamW, ZeRO-Offload and
FSDP2's CPUOffloadPolicy.

    python benchmarks/offload_step.py                       # needs a GPU; exits 0 without one
    python benchmarks/offload_step.py --layers 8 --batch 4  # a smaller run

In one process, one after the other on the same model and batches, it times a full training step
(forward, backward, optimizer step, device synchronized) and records the peak device memory of:

* all on the GPU: FP32 weights, bf16 autocast, ``torch.optim.AdamW(fused=True)`` (16 B/param);
* ``hetero.optim.OffloadAdamW(param_dtype=bfloat16)``: bf16 weights on the GPU, FP32 master and
  moments on the host, gradients copied out during backward;
* DeepSpeed ZeRO-Offload: ZeRO stage 2 with ``offload_optimizer: cpu`` (DeepSpeedCPUAdam), bf16
  (skipped, named, where DeepSpeed is not installed or its CPU Adam cannot be built);
* FSDP2 with ``CPUOffloadPolicy`` on a one-rank mesh, every block a unit, bf16 compute
  (``MixedPrecisionPolicy``): FP32 weights and their AdamW on the host.

Each row also gives the share of a step the device sat idle: one more step runs under torch's
profiler, and the time no kernel or copy ran on the device (the union of their intervals) is
divided by the step's wall time. The model is ``recipes/gpt.py``'s GPT (d_model 2048, 20 layers,
vocab 50304: 1.1 B parameters; ``--layers 24``: 1.3 B).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import foundation.device as hd
import parallel
from hetero.optim import OffloadAdamW

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: recipes
from recipes.gpt import GPT  # noqa: E402

LR, BETAS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 0.1


def build_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq).to(hd.resolve("device"))


def all_on_device(args: argparse.Namespace) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                            fused=True)
    device_type = hd.resolve("device").type

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def offload_adamw(args: argparse.Namespace) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = build_model(args)
    opt = OffloadAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                       param_dtype=torch.bfloat16, kernel=args.kernel)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def zero_offload(args: argparse.Namespace) -> Callable[[torch.Tensor, torch.Tensor], None]:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS),
                                                  "weight_decay": WEIGHT_DECAY}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    model = build_model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
    return step


def fsdp2_cpu_offload(args: argparse.Namespace
                      ) -> Callable[[torch.Tensor, torch.Tensor], None]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from parallel.dims import build_mesh

    model = build_model(args)
    mesh = build_mesh((1,), ("dp",))
    policy = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=hd.can_pin()),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32))
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def idle_share(step: Callable[[], None]) -> float:
    """The share of one ``step()`` the device sat idle: no kernel or copy running on it (the
    union of their intervals under torch's profiler) over the step's wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import profile, supported_activities

    hd.synchronize()
    with profile(activities=supported_activities()) as prof:
        start = time.perf_counter()
        step()
        hd.synchronize()
        wall = time.perf_counter() - start
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type != DeviceType.CPU)
    busy, reach = 0.0, float("-inf")
    for begin, end in spans:  # microseconds
        if end > reach:
            busy += end - max(begin, reach)
            reach = end
    return max(0.0, 1.0 - busy * 1e-6 / wall)


def measure(make: Callable, args: argparse.Namespace) -> tuple[float, float, float]:
    """(median step seconds, peak device GiB, idle share) of the step ``make(args)`` builds."""
    step = make(args)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
               .to(hd.resolve("device")) for _ in range(2)]
    hd.synchronize()
    torch.accelerator.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        batch = batches[i % 2]
        hd.synchronize()
        start = time.perf_counter()
        step(batch[:, :-1], batch[:, 1:])
        hd.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.accelerator.max_memory_allocated() / 2**30
    idle = idle_share(functools.partial(step, batches[0][:, :-1], batches[0][:, 1:]))
    del step
    gc.collect()
    torch.accelerator.memory.empty_cache()
    return statistics.median(times), peak, idle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kernel", default="auto", help="OffloadAdamW kernel")
    args = parser.parse_args()
    if not hd.has_accelerator():
        print("no GPU available: benchmarks/offload_step.py measures device step time and device "
              "memory, so it has nothing to measure on this host-only machine")
        return 0
    parallel.init()  # a world-size-1 process group, which DeepSpeed expects
    n = sum(p.numel() for p in GPT(args.vocab, args.d_model, args.layers, args.heads,
                                   args.seq).parameters())
    print(f"GPT {n / 1e9:.2f} B parameters, batch {args.batch} x {args.seq} tokens, "
          f"{hd.resolve('device')} ({torch.get_num_threads()} host threads)")
    rows = []
    for name, make in [("all on GPU, fused AdamW (bf16 autocast)", all_on_device),
                       ("OffloadAdamW (bf16 weights)", offload_adamw),
                       ("DeepSpeed ZeRO-Offload (stage 2, bf16)", zero_offload),
                       ("FSDP2 CPUOffloadPolicy (bf16 compute)", fsdp2_cpu_offload)]:
        try:
            rows.append((name, *measure(make, args)))
        except Exception as err:  # DeepSpeed missing, or a config that does not fit
            print(f"{name}: failed: {type(err).__name__}: {str(err)[:200]}")
    base = rows[0][1] if rows and rows[0][0].startswith("all on GPU") else None
    print(f"{'configuration':<42} {'step ms':>9} {'vs GPU':>7} {'peak GiB':>9} {'B/param':>8} "
          f"{'idle':>5}")
    for name, seconds, peak, idle in rows:
        ratio = f"{seconds / base:7.2f}" if base else "      -"
        print(f"{name:<42} {seconds * 1e3:>9.1f} {ratio} {peak:>9.2f} {peak * 2**30 / n:>8.1f} "
              f"{idle:>5.0%}")
    ours = next((r for r in rows if r[0].startswith("OffloadAdamW")), None)
    peers = {r[0]: r[1] for r in rows if not r[0].startswith(("OffloadAdamW", "all on"))}
    if ours is not None and peers:  # one line with every ratio: what make device-check reads
        print("OffloadAdamW step vs " + ", ".join(f"{name.split(' (')[0]} {ours[1] / sec:.2f}x"
                                                  for name, sec in peers.items())
              + f"; idle {ours[3]:.0%}, peak {ours[2]:.2f} GiB")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
