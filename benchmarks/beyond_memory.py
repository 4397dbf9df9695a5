"""Train a GPT whose training state is larger than this machine's memory (issue 37's headline).

    python benchmarks/beyond_memory.py                        # >= 2.0 B parameters, 3 steps
    python benchmarks/beyond_memory.py --params 3e8 --dir /mnt/nvme --steps 2

A GPT of ``--params`` parameters is built on the meta device and materialised in bf16 on the host
(2 B per parameter), one tensor at a time by its own init rules. Its FP32 master weights and both
Adam moments (12 B per parameter) live in files under ``--dir`` (:class:`hetero.offload.DiskAdamW`),
streamed a chunk at a time at every step; the host holds the bf16 weights, their bf16 gradients
and three chunk buffers. Full training state, FP32 Adam's 16 B per parameter, is what the first
line prints against the machine's memory.

The training runs in a child process; this process samples the child's resident set from outside
every 20 ms, and the child prints the kernel's own high-water mark (``VmHWM``) at its end. Before
the model is built, the child measures the directory's sequential direct-IO bandwidth with a file
the size of the optimizer state (one write pass, one read pass, the same file class and chunk size
as the optimizer), and the same pass through DeepSpeed's libaio ``aio`` op where it builds. Each
step prints its forward+backward seconds and its optimizer-step seconds against the bound that
bandwidth sets for the bytes the step moves (every state byte read and written once). Minutes
long for 2 B parameters: a benchmark; the suite runs it on a small model.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

STATE_BYTES = 12  # FP32 master, exp_avg, exp_avg_sq per parameter, on disk
TRAINING_BYTES = 16  # ... plus the 16-bit weight and gradient: what FP32 Adam training holds


def gpt_shape(params: float, d_model: int, vocab: int) -> int:
    """The fewest layers of width ``d_model`` that give the recipe GPT ``params`` parameters
    (12 d^2 + 13 d per block, a tied vocab x d embedding)."""
    per_block = 12 * d_model * d_model + 13 * d_model
    return max(1, math.ceil((params - vocab * d_model) / per_block))


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: recipes
    from disk_optimizer import deepspeed_aio_floor, disk_floor

    from hetero.offload import DiskAdamW, OffloadPolicy, apply_offload
    from recipes.gpt import GPT

    directory = Path(args.dir)
    n_layer = gpt_shape(args.params, args.d_model, args.vocab)
    with torch.device("meta"):
        shape = GPT(args.vocab, args.d_model, n_layer, args.d_model // 128, args.seq)
    numel = sum(p.numel() for p in shape.parameters())
    state = numel * STATE_BYTES
    memory = psutil.virtual_memory().total
    print(f"GPT d_model={args.d_model} n_layer={n_layer}: {numel / 1e9:.2f} B parameters "
          f"(weights and gradients at rest: {args.weights}); "
          f"FP32 Adam training state {numel * TRAINING_BYTES / 2**30:.1f} GiB against "
          f"{memory / 2**30:.1f} GiB of memory; optimizer state on disk "
          f"{state / 2**30:.1f} GiB in {directory}", flush=True)

    floor_s = disk_floor(directory, numel, args.chunk_mb, direct=True)
    bandwidth = 2 * state / floor_s
    print(f"sequential direct IO there: {2 * state / 1e9:.1f} GB written and read in "
          f"{floor_s:.1f} s ({bandwidth / 1e9:.2f} GB/s)", flush=True)
    aio_s = deepspeed_aio_floor(directory, numel, args.chunk_mb) if args.deepspeed else None
    if aio_s is not None:
        print(f"the same through DeepSpeed's aio op (libaio): {aio_s:.1f} s "
              f"({2 * state / aio_s / 1e9:.2f} GB/s, {floor_s / aio_s:.2f}x ours)", flush=True)

    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(args.vocab, args.d_model, n_layer, args.d_model // 128, args.seq)
    model.to(torch.bfloat16)  # still on meta: bf16 storage, 2 B per parameter, once made

    @torch.no_grad()
    def init(name: str, tensor: torch.Tensor) -> None:  # drawn in FP32 by the model's rules
        full = torch.empty(tensor.shape)
        model.init_parameter(name, full)
        tensor.copy_(full)

    if args.weights == "disk":  # weights and gradients made straight in a mapped file
        done = apply_offload(model, OffloadPolicy(params="disk", optimizer="disk",
                                                  path=str(directory)), device="cpu",
                             init=init)
        optimizer = done.optimizer(model.parameters(), lr=args.lr, chunk_mb=args.chunk_mb)
    else:
        model.to_empty(device="cpu")
        model.lm_head.weight = model.tok_emb.weight  # to_empty makes each module its own
        for name, p in model.named_parameters():
            init(name, p)
        optimizer = DiskAdamW(model.parameters(), lr=args.lr, path=directory,
                              chunk_mb=args.chunk_mb)
    print(f"built and seeded in {time.perf_counter() - start:.1f} s (direct IO: "
          f"{optimizer.direct})", flush=True)

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]
    bound = 2 * state / bandwidth
    print("| step | loss | forward+backward s | optimizer step s | step / disk bound | "
          "GB/s moved |")
    print("| --- | --- | --- | --- | --- | --- |")
    for step in range(args.steps):
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        print(f"| {step} | {loss.item():.4f} | {t1 - t0:.1f} | {t2 - t1:.1f} | "
              f"{(t2 - t1) / bound:.2f}x | {2 * state / (t2 - t1) / 1e9:.2f} |", flush=True)
    if args.checkpoint:
        checkpoint_round_trip(model, optimizer, directory / "checkpoint", x, y)
    optimizer.close()
    with open("/proc/self/status") as status:
        hwm = next(line.split()[1] for line in status if line.startswith("VmHWM"))
    print(f"child VmHWM {int(hwm) / 2**20:.2f} GiB", flush=True)


def checkpoint_round_trip(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          where: Path, x: torch.Tensor, y: torch.Tensor) -> None:
    """Save the model and the disk-resident optimizer state with torch.distributed.checkpoint,
    load them back (the state straight into its file), and take one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where, no_dist=True)
    t1 = time.perf_counter()
    written = sum(f.stat().st_size for f in where.iterdir())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=where, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    del model_sd, optim_sd
    t2 = time.perf_counter()
    print(f"DCP checkpoint of {written / 2**30:.1f} GiB: saved in {t1 - t0:.1f} s "
          f"({written / (t1 - t0) / 1e9:.2f} GB/s), loaded in {t2 - t1:.1f} s "
          f"({written / (t2 - t1) / 1e9:.2f} GB/s)", flush=True)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"a step after the resume: loss {loss.item():.4f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2.0e9)
    ap.add_argument("--d-model", dest="d_model", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--chunk-mb", dest="chunk_mb", type=float, default=64.0)
    ap.add_argument("--dir", default=None, help="where the state files go (default: a temp dir "
                    "under the working directory, on its disk)")
    ap.add_argument("--weights", choices=("host", "disk"), default="host",
                    help="where the bf16 weights and gradients rest: host memory, or a mapped "
                    "file beside the optimizer state (OffloadPolicy(params='disk'))")
    ap.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the IO pass through DeepSpeed's aio op where it builds")
    ap.add_argument("--checkpoint", action="store_true",
                    help="after the steps, save and load a DCP checkpoint of the model and the "
                    "disk-resident state (under --dir), then take one more step")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as tmp:
        argv = [sys.executable, __file__, "--worker", "--dir", tmp,
                "--deepspeed" if args.deepspeed else "--no-deepspeed",
                *(["--checkpoint"] if args.checkpoint else []),
                *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k not in ("worker", "dir", "deepspeed", "checkpoint"))]
        child = subprocess.Popen(argv)
        peak, anonymous, proc = 0, 0, psutil.Process(child.pid)
        while child.poll() is None:
            try:
                info = proc.memory_info()
            except psutil.NoSuchProcess:
                break
            # shared: the file-backed pages mapped in (the state's file while a checkpoint
            # reads or writes it through the page cache, which the kernel can reclaim)
            peak, anonymous = max(peak, info.rss), max(anonymous, info.rss - info.shared)
            time.sleep(0.02)
        print(f"peak RSS of the training process, sampled from outside: {peak / 2**30:.2f} GiB "
              f"(anonymous memory: {anonymous / 2**30:.2f} GiB)")
        if child.returncode:
            raise SystemExit(child.returncode)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
