"""Host Adam kernels against the host's memory bandwidth, in one process.

    python benchmarks/host_adam.py                 # 50 M parameters, all cores
    python benchmarks/host_adam.py --params 20e6 --repeats 9 --threads 4

The job each kernel does is what OffloadAdamW needs per step: read a bf16 gradient, update the FP32
master weight and both FP32 moments, write the bf16 weight that goes back to the device. At least
28 bytes cross the memory bus per parameter (read 4+2+4+4, write 4+4+4+2), so the bound is
``triad bandwidth / 28`` parameters per second, with the bandwidth measured here by the STREAM
triad ``a = b + s * c`` on FP32 arrays (12 bytes per element, STREAM's convention).

Rows: ours (the fused compiled kernel, and the "torch"/"deepspeed" kernels, which do the casts
around those libraries' updates), and the peers as a user would run them on FP32 master weights:
``torch.optim.AdamW(fused=True)`` and ``DeepSpeedCPUAdam``, each with the gradient upcast and the
weight downcast as separate passes. The "core" rows time the bare update (FP32 gradient, no
downcast) for reference. DeepSpeed's op is built on first use (a minute or two, then cached).

Then the host step by thread count: the compiled kernel with one thread (what torchrun's
``OMP_NUM_THREADS=1`` gives every rank) and with the cores a rank owns
(``foundation.host_threads.cores_per_rank()``, which ``OffloadAdamW(host_threads=None)`` uses),
and a device row: ``OffloadAdamW.step()`` on 16-bit parameters on the accelerator (gradients
off the device, host update, weights back, timed to the device's synchronize), skipped with the
reason where there is no accelerator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import foundation.device as hd
from foundation.host_threads import cores_per_rank, thread_scope
from hetero.optim import OffloadAdamW
from hetero.optim.compiled_kernel import CompiledKernel
from hetero.optim.host_kernels import DeepSpeedKernel, Hyper, Run, TorchKernel

BYTES_PER_PARAM = 28
HYPER = Hyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


def round_robin(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each case, timed in interleaved rounds: on a shared machine the load
    drifts, and interleaving exposes every case to the same drift."""
    for fn in cases.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class State:
    """FP32 master and moments, a bf16 gradient and a bf16 output of ``n`` elements."""

    def __init__(self, n: int) -> None:
        self.master = torch.randn(n)
        self.exp_avg = torch.zeros(n)
        self.exp_avg_sq = torch.zeros(n)
        self.grad16 = torch.randn(n).to(torch.bfloat16)
        self.out16 = torch.empty(n, dtype=torch.bfloat16)
        self.grad32 = self.grad16.float()

    def run(self, fp32_grad: bool = False, downcast: bool = True) -> Run:
        return Run(self.master, self.grad32 if fp32_grad else self.grad16, self.exp_avg,
                   self.exp_avg_sq, self.out16 if downcast else None, step=10)


def torch_optimizer_peer(state: State) -> Callable[[], None]:
    """torch.optim.AdamW(fused=True) on an FP32 master, plus the two casts."""
    master = torch.nn.Parameter(state.master)
    opt = torch.optim.AdamW([master], lr=HYPER.lr, weight_decay=HYPER.weight_decay, fused=True)
    master.grad = torch.empty_like(master)

    def step() -> None:
        master.grad.copy_(state.grad16)
        opt.step()
        state.out16.copy_(master.detach())
    return step


def deepspeed_optimizer_peer(state: State) -> Callable[[], None]:
    """DeepSpeedCPUAdam (adamw_mode) on an FP32 master, plus the two casts."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    master = torch.nn.Parameter(state.master)
    opt = DeepSpeedCPUAdam([master], lr=HYPER.lr, weight_decay=HYPER.weight_decay)
    master.grad = torch.empty_like(master)

    def step() -> None:
        master.grad.copy_(state.grad16)
        opt.step()
        state.out16.copy_(master.detach())
    return step


def thread_rows(state: State, repeats: int, local_ranks: int = 1,
                kernel_type: type = CompiledKernel) -> dict[int, float]:
    """Median seconds of a kernel's step (ours, compiled, by default) with 1 thread and with the
    cores a rank owns when ``local_ranks`` ranks share this host, keyed by thread count."""
    kernel = kernel_type()
    counts = sorted({1, cores_per_rank(local_ranks)})

    def under(threads: int) -> Callable[[], None]:
        def step() -> None:
            with thread_scope(threads):
                kernel.update([state.run()], HYPER)
        return step
    seconds = round_robin({str(t): under(t) for t in counts}, repeats)
    return {int(t): s for t, s in seconds.items()}


def device_row(n: int, repeats: int) -> str:
    """``OffloadAdamW.step()`` of ``n`` bf16 parameters on the accelerator, in M params/s, or
    why it is skipped."""
    if not hd.has_accelerator():
        return f"device row skipped: no accelerator here ({hd.build_facts()})"
    device = hd.resolve("device")
    param = torch.nn.Parameter(torch.randn(n, device=device))
    opt = OffloadAdamW([param], lr=HYPER.lr, param_dtype=torch.bfloat16)

    def step() -> None:
        param.grad = torch.ones_like(param)
        opt.step()
        hd.synchronize()
    seconds = round_robin({"device": step}, repeats)["device"]
    return (f"OffloadAdamW.step on {device} (bf16, {opt.host_threads} host threads): "
            f"{seconds * 1e3:.1f} ms, {n / seconds / 1e6:.0f} M params/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--local-ranks", type=int, default=1,
                        help="ranks sharing this host, for the per-rank thread row "
                             "(default: $LOCAL_WORLD_SIZE, else 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    state = State(n)

    def kernel(factory, fp32_grad=False, downcast=True):
        def make():
            k = factory()
            return lambda: k.update([state.run(fp32_grad, downcast)], HYPER)
        return make

    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    makers = [
        ("triad a = b + s*c", lambda: lambda: torch.add(b, c, alpha=3.0, out=a)),
        ("compiled (ours, fused)", kernel(CompiledKernel)),
        ("torch kernel (ours, casts around it)", kernel(TorchKernel)),
        ("deepspeed kernel (ours, casts around it)", kernel(DeepSpeedKernel)),
        ("torch AdamW(fused) + casts", lambda: torch_optimizer_peer(state)),
        ("DeepSpeedCPUAdam + casts", lambda: deepspeed_optimizer_peer(state)),
        ("core: compiled, fp32 grad, no cast", kernel(CompiledKernel, True, False)),
        ("core: torch fused, fp32 grad, no cast", kernel(TorchKernel, True, False)),
        ("core: deepspeed, fp32 grad, no cast", kernel(DeepSpeedKernel, True, False)),
    ]
    cases = {}
    for name, make in makers:
        try:
            cases[name] = make()
        except Exception as err:  # DeepSpeed missing or unbuildable: report and go on
            print(f"{name:<40} unavailable: {type(err).__name__}: {str(err)[:120]}")
    seconds = round_robin(cases, args.repeats)
    bandwidth = 12 * n / seconds.pop("triad a = b + s*c")
    bound = bandwidth / BYTES_PER_PARAM
    rows = {name: n / t for name, t in seconds.items()}
    print(f"{n / 1e6:.0f} M parameters, {torch.get_num_threads()} threads, median of "
          f"{args.repeats} interleaved rounds; triad {bandwidth / 1e9:.1f} GB/s -> bound "
          f"{bound / 1e6:.0f} M params/s at {BYTES_PER_PARAM} B/param")
    peer = rows.get("DeepSpeedCPUAdam + casts")
    print(f"{'kernel':<40} {'M params/s':>11} {'GB/s@28B':>9} {'of bound':>9} {'vs DS':>6}")
    for name, rate in rows.items():
        versus = f"{rate / peer:6.2f}" if peer else "     -"
        print(f"{name:<40} {rate / 1e6:>11.0f} {rate * BYTES_PER_PARAM / 1e9:>9.1f} "
              f"{rate / bound:>9.2f} {versus}")
    ours = rows.get("compiled (ours, fused)")
    if ours:
        goal = f"goal >= 0.9 of bound: {ours / bound:.2f}"
        if peer:
            goal += f"; goal >= 1.2x DeepSpeedCPUAdam: {ours / peer:.2f}x"
        print(goal)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.local_ranks))
    by_threads = thread_rows(state, args.repeats, local_ranks)
    print(f"compiled step by host threads ({local_ranks} rank(s) per host): " + ", ".join(
        f"{t} thread{'s' * (t > 1)} {sec * 1e3:.1f} ms" for t, sec in by_threads.items()))
    print(device_row(n, args.repeats))
    if max(rows.values()) > 1.05 * bound:
        print("note: kernels beat the triad 'bound' here, so triad does not saturate this host's "
              "memory (few cores, each limited by its outstanding misses; reads are cheaper than "
              "writes); compare the kernels with each other")


if __name__ == "__main__":
    main()
