"""``make device-check``: validate a machine's accelerator in one command, one markdown table out.

In priority order, each step under its own time limit (the whole check fits in 40 minutes on one
device): (1) environment facts, (2) every ``cuda``/``npu``-marked test with nothing skipped,
(3) the in-process suite with "device" resolving to the accelerator, (4) the default recipe on one
device, with ``offload=optimizer`` (bf16 and fp16), ``hetero=embedding_on_cpu`` and a
checkpoint/resume round trip, each compared with the same run on the CPU, (5) the benchmarks with
device rows, (6) with N > 1 devices, the recipe's parallel modes on N ranks. Without an
accelerator the CPU-possible steps run and the device steps are reported as skipped, naming why.

Why a script and not pytest: the recipe and benchmark steps are whole programs (torchrun, their
own process groups and device state); each runs in a subprocess whose exit code, time and last
figures go into the table.

    python benchmarks/device_check.py [--out device_check.md] [--steps 30] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import foundation.device as hd  # noqa: E402

# the recipe's loss on the accelerator against the CPU's: bf16/fp16 weights round differently
TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2, "fp16": 3e-2}


@dataclasses.dataclass
class Row:
    step: str
    result: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0


def _run(cmd: list[str], timeout: int, env: dict[str, str] | None = None
         ) -> tuple[int, str, float]:
    """(exit code, the output's tail, seconds) of ``cmd`` run from the repository root."""
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, out = 124, f"timed out after {timeout} s\n{err.stdout or ''}"
    return code, out[-4000:], time.perf_counter() - start


def _last_line(text: str, *keys: str) -> str:
    """The last line of ``text`` naming one of ``keys`` with a figure in it (a table's header
    names them too, without a number), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if any(k in ln for k in keys)
            and any(c.isdigit() for c in ln)] or lines
    return hits[-1][:160] if hits else ""


def environment() -> Row:
    kind = hd.accelerator_type()
    facts = [hd.build_facts(), f"accelerator {kind or 'none'}", f"device {hd.resolve('device')}",
             f"backend {hd.default_backend_string()}"]
    if kind is not None:
        facts.append(f"{hd.device_count()} visible")
    return Row("environment", "PASS", "; ".join(facts))


def marked_tests(has_device: bool) -> Row:
    if not has_device:
        return Row("cuda/npu-marked tests", "SKIP", "no accelerator on this machine")
    # the tests marked for the accelerator present (the pytest marker is its type's name): a
    # GPU machine skips the npu-marked ones and an NPU machine the cuda-marked ones
    code, out, secs = _run([sys.executable, "-m", "pytest", "-q", "-m", str(hd.accelerator_type()),
                            "-rs", "-p", "no:cacheprovider"], 600)
    skipped = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    ok = code == 0 and not skipped
    detail = _last_line(out, "passed", "failed", "error")
    if skipped:
        detail += f"; {len(skipped)} skipped (none may be): {skipped[0][:80]}"
    return Row("cuda/npu-marked tests", "PASS" if ok else "FAIL", detail, secs)


def in_process_suite(quick: bool) -> Row:
    args = ["-m", "not slow"] + (["-x", "tests/test_device.py", "tests/test_placement.py"]
                                 if quick else [])
    code, out, secs = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *args], 600)
    return Row("in-process suite (`-m 'not slow'`)", "PASS" if code == 0 else "FAIL",
               _last_line(out, "passed", "failed", "error"), secs)


def _recipe(run_dir: Path, steps: int, *overrides: str) -> tuple[int, dict[int, float], float,
                                                                    str]:
    code, out, secs = _run([sys.executable, "recipes/train.py", f"trainer.max_steps={steps}",
                            "trainer.progress_bar=false", "parallel=none",
                            f"hydra.run.dir={run_dir}", *overrides], 600)
    losses = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            losses[row["step"]] = row["loss"]
    return code, losses, secs, out


def recipes(has_device: bool, steps: int, work: Path) -> list[Row]:
    """The default recipe and its hetero variants, each on the device and on the CPU."""
    variants = {"default": ((), "fp32"),
                "offload=optimizer (bf16)": (("offload=optimizer",), "bf16"),
                "offload=optimizer (fp16)": (("offload=optimizer", "offload.param_dtype=float16"),
                                             "fp16"),
                "offload=params (bf16)": (("offload=params", "offload.param_dtype=bfloat16"),
                                          "bf16"),
                "hetero=embedding_on_cpu": (("hetero=embedding_on_cpu",), "fp32")}
    rows = []
    for name, (overrides, precision) in variants.items():
        tag = name.replace(" ", "_").replace("=", "-").replace("(", "").replace(")", "")
        code, cpu, secs, out = _recipe(work / f"{tag}_cpu", steps, *overrides, "hetero.device=cpu")
        if code != 0:
            rows.append(Row(f"recipe {name} (cpu)", "FAIL", _last_line(out, "Error"), secs))
            continue
        if not has_device:
            rows.append(Row(f"recipe {name}", "SKIP", f"no accelerator; on the cpu: loss "
                        f"{cpu[1]:.4f} -> {cpu[steps]:.4f} in {steps} steps", secs))
            continue
        code, dev, secs, out = _recipe(work / f"{tag}_dev", steps, *overrides)
        if code != 0:
            rows.append(Row(f"recipe {name}", "FAIL", _last_line(out, "Error"), secs))
            continue
        worst = max(abs(dev[s] - cpu[s]) / abs(cpu[s]) for s in cpu)
        ok = worst <= TOLERANCE[precision]
        rows.append(Row(f"recipe {name}", "PASS" if ok else "FAIL",
                        f"loss {dev[1]:.4f} -> {dev[steps]:.4f}; worst relative gap to the cpu "
                        f"{worst:.1e} (tolerance {TOLERANCE[precision]:.0e})", secs))
    rows.append(_resume(has_device, steps, work))
    return rows


def _resume(has_device: bool, steps: int, work: Path) -> Row:
    """A run stopped at half its steps and resumed continues with the uninterrupted losses."""
    device = () if has_device else ("hetero.device=cpu",)
    whole = work / "resume_whole"
    code, want, secs, out = _recipe(whole, steps, f"trainer.checkpoint_every={steps // 2}",
                                    *device)
    if code != 0:
        return Row("checkpoint/resume round trip", "FAIL", _last_line(out, "Error"), secs)
    half = whole / "checkpoints" / f"step_{steps // 2:06d}"
    code, got, more, out = _recipe(work / "resume_again", steps, f"trainer.resume_from={half}",
                                   *device)
    # bitwise on the host; on a device within 1e-5: the run does not ask for deterministic
    # kernels (cuBLAS workspaces, atomic adds in backward), whose sums may round differently
    tolerance = 1e-5 if has_device else 0.0
    same = code == 0 and max(got) == steps and all(
        abs(got[s] - want[s]) <= tolerance * abs(want[s]) for s in got)
    agree = "identical" if tolerance == 0 else f"within {tolerance:.0e}"
    return Row("checkpoint/resume round trip", "PASS" if same else "FAIL",
               f"resumed at step {steps // 2}: losses {agree if same else 'differ'}"
               + ("" if has_device else " (on the cpu)"), secs + more)


BENCHMARKS = {  # script -> (arguments, what the line with its figures holds)
    "benchmarks/offload_step.py": (["--layers", "4", "--d-model", "1024", "--steps", "5"],
                                   ("OffloadAdamW (bf16",)),  # ours against the GPU step
    "benchmarks/offload_memory.py": (["--layers", "8", "--d-model", "1024", "--repeats", "5"],
                                     ("summary",)),
    "benchmarks/placement_overhead.py": (["--steps", "10"], ("embedding on cpu",)),
    "benchmarks/embedding.py": ([], ("ratio (ours",)),
}


def benchmarks(has_device: bool) -> list[Row]:
    rows = []
    for script, (args, keys) in BENCHMARKS.items():
        if not has_device:
            rows.append(Row(script, "SKIP", "no accelerator (its device rows need one)"))
            continue
        code, out, secs = _run([sys.executable, script, *args], 600)
        rows.append(Row(script, "PASS" if code == 0 else "FAIL", _last_line(out, *keys), secs))
    return rows


def collectives(has_device: bool) -> Row:
    """Our collectives against torch's, on every device (gloo ranks on a host-only machine)."""
    code, out, secs = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={max(1, hd.device_count()) if has_device else 2}",
                            "benchmarks/collectives.py"], 600, {"OMP_NUM_THREADS": "1"})
    return Row("benchmarks/collectives.py", "PASS" if code == 0 else "FAIL", _last_line(out),
               secs)


MODES = {"data": ("parallel=data",), "semi_auto": ("parallel=semi_auto",),
         "pipeline": ("parallel=pipeline",), "expert": ("model=gpt_moe", "parallel=expert"),
         "optimizer parallel": ("parallel=data", "parallel.enable_parallel_optimizer=true",
                                "parallel.optimizer_level=level2")}


def parallel_modes(steps: int, work: Path) -> list[Row]:
    count = hd.device_count() if hd.has_accelerator() else 0
    if count < 2:
        return [Row("parallel modes on N devices", "SKIP",
                    f"{count} accelerator(s): needs 2 or more")]
    rows = []
    for name, overrides in MODES.items():
        run = work / f"mode_{name.replace(' ', '_')}"
        code, out, secs = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={count}", "recipes/train.py",
                                f"trainer.max_steps={steps}", "trainer.progress_bar=false",
                                f"hydra.run.dir={run}", *overrides], 600)
        rows.append(Row(f"recipe {name} on {count} devices", "PASS" if code == 0 else "FAIL",
                        _last_line(out, "Error") if code else f"{steps} steps", secs))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| step | result | figures | s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.step} | {r.result} | {r.detail.replace('|', '/')} | {r.seconds:.0f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) /
                        "device_check.md")
    parser.add_argument("--steps", type=int, default=30, help="recipe steps per run (even)")
    parser.add_argument("--quick", action="store_true",
                        help="two test files instead of the in-process suite")
    args = parser.parse_args()
    has_device = hd.has_accelerator()
    rows = [environment(), marked_tests(has_device), in_process_suite(args.quick)]
    with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
        rows += recipes(has_device, args.steps, Path(tmp))
        rows += [*benchmarks(has_device), collectives(has_device)]
        rows += parallel_modes(args.steps, Path(tmp))
    text = table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text, end="")
    print(f"written to {args.out}")
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
