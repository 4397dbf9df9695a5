"""``make device-check``: the ten-minute acceptance run of a machine's accelerators, one markdown
table out (issue 39).

What a first run on a 1-GPU or an 8-GPU node must answer, each row with its peer and every
skipped row saying why, all inside :data:`BUDGET_S` (a row that no longer fits is reported as
not run, with the seconds left):

* the environment (torch build, device, backend) and the tests marked for this accelerator;
* host<->device copy bandwidth of pinned memory against the link's bound;
* a 1.3 B-parameter offloaded step: ``OffloadAdamW`` against fused AdamW on the device, DeepSpeed
  ZeRO-Offload (where installed) and FSDP2's ``CPUOffloadPolicy``: step time, peak device memory,
  the share of the step the device sat idle (``benchmarks/offload_step.py``);
* a run stopped and resumed with ``trainer.deterministic=true``: the same losses bit for bit;
* the default recipe and parameter offload on the device against the same runs on the CPU;
* with two or more devices (``device_check_multi.py``): collectives' bus bandwidth, data parallel
  against DDP, optimizer parallel against FSDP2, tensor parallel against ``parallelize_module``,
  context parallel against torch's, every mode's losses against one device's, and a killed rank.

It runs the node's own torch as it is (nothing is installed): on a machine without a registry
give it its pure-Python needs first (``make device-wheels`` where pip works, then the README's
offline line). The same command on a host-only machine runs end to end, the device rows skipped.

    python benchmarks/device_check.py [--out device_check.md] [--budget 570]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from device_rows import (  # noqa: E402
    TOLERANCE,
    Budget,
    Row,
    last_line,
    recipe_run,
    run_command,
    skip_without_device,
    table,
)

import foundation.device as hd  # noqa: E402

#: seconds the whole check may take: under the 10 minutes a lent machine gives one command
BUDGET_S = 570.0


# ------------------------------------------------------------------ the rows
def environment() -> Row:
    kind = hd.accelerator_type()
    facts = [hd.build_facts(), f"accelerator {kind or 'none'}", f"device {hd.resolve('device')}",
             f"backend {hd.default_backend_string()}"]
    if kind is not None:
        facts.append(f"{hd.device_count()} visible, {hd.device_model()}")
    return Row("environment", "PASS", "; ".join(facts))


def marked_test_files(kind: str) -> list[str]:
    """The test files holding a test marked for accelerator ``kind`` (pytest's marker is the
    type's name): only those run, so a module needing what the node lacks is never collected."""
    mark = re.compile(rf"^\s*(@pytest\.mark\.{kind}\b|pytestmark\s*=.*\bpytest\.mark\.{kind}\b)",
                      re.MULTILINE)
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if mark.search(p.read_text()))


def marked_tests(has_device: bool, timeout: float) -> Row:
    name = "tests marked for this accelerator"
    if (skip := skip_without_device(name, has_device)) is not None:
        return skip
    kind = str(hd.accelerator_type())
    files = marked_test_files(kind)
    code, out, secs = run_command([sys.executable, "-m", "pytest", "-q", "-m", kind, "-rs",
                            "-p", "no:cacheprovider", *files], timeout)
    skipped = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    detail = f"{len(files)} files: " + last_line(out, "passed", "failed", "error")
    if skipped:
        detail += f"; {len(skipped)} skipped (none may be): {skipped[0][:80]}"
    return Row(name, "PASS" if code == 0 and not skipped else "FAIL", detail, secs)


def copy_bandwidth(has_device: bool, size_mib: int = 512, repeats: int = 5) -> Row:
    """Pinned host memory to the device and back, against the link's bound where the device
    module knows it (the PCIe generation and width the driver reports)."""
    name = "host<->device copy bandwidth (pinned)"
    if (skip := skip_without_device(name, has_device)) is not None:
        return skip
    start = time.perf_counter()
    device = hd.resolve("device")
    host = hd.pinned_empty((size_mib * 2**20 // 4,), torch.float32)
    there = torch.empty(host.shape, device=device)

    def rate(copy: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            hd.synchronize()
            begin = time.perf_counter()
            copy()
            hd.synchronize()
            times.append(time.perf_counter() - begin)
        return host.nbytes / statistics.median(times) / 1e9
    to_device = rate(lambda: there.copy_(host, non_blocking=True))
    to_host = rate(lambda: host.copy_(there, non_blocking=True))
    bound = hd.host_link_bytes_per_s()
    detail = f"to the device {to_device:.1f} GB/s, to the host {to_host:.1f} GB/s"
    if bound is None:
        return Row(name, "PASS", detail + "; the link's bound is unknown here",
                   time.perf_counter() - start)
    share = min(to_device, to_host) / (bound / 1e9)
    return Row(name, "PASS" if share >= 0.6 else "FAIL",
               f"{detail}; {share:.2f}x the link's {bound / 1e9:.0f} GB/s (at least 0.6x)",
               time.perf_counter() - start)


def offloaded_step(has_device: bool, timeout: float) -> Row:
    name = "1.3 B offloaded step (benchmarks/offload_step.py --layers 24)"
    if (skip := skip_without_device(name, has_device)) is not None:
        return skip
    code, out, secs = run_command([sys.executable, "benchmarks/offload_step.py", "--layers", "24",
                            "--batch", "4", "--warmup", "1", "--steps", "3"], timeout)
    return Row(name, "PASS" if code == 0 else "FAIL", last_line(out, "OffloadAdamW step vs"),
               secs)


def deterministic_resume(has_device: bool, steps: int, work: Path, timeout: float) -> Row:
    """A run stopped at half its steps and resumed, ``trainer.deterministic=true``: the
    uninterrupted run's losses bit for bit, on the device (on the host without one)."""
    name = "resume with trainer.deterministic=true"
    where = () if has_device else ("hetero.device=cpu",)
    flags = ("trainer.deterministic=true", *where)
    whole = work / "resume_whole"
    code, want, secs, out = recipe_run(whole, steps, timeout / 2,
                                    f"trainer.checkpoint_every={steps // 2}", *flags)
    if code != 0:
        return Row(name, "FAIL", last_line(out, "Error"), secs)
    half = whole / "checkpoints" / f"step_{steps // 2:06d}"
    code, got, more, out = recipe_run(work / "resume_again", steps, timeout / 2,
                                   f"trainer.resume_from={half}", *flags)
    same = code == 0 and max(got, default=0) == steps and all(got[s] == want[s] for s in got)
    return Row(name, "PASS" if same else "FAIL",
               f"resumed at step {steps // 2}: losses {'identical' if same else 'differ'}"
               + ("" if has_device else " (on the host: no accelerator)"), secs + more)


def recipe_against_the_host(has_device: bool, steps: int, work: Path, timeout: float
                            ) -> list[Row]:
    """The default recipe and parameter offload on the device, each against the same run on
    the host."""
    variants = {"default": ((), "fp32"),
                "offload=params (bf16)": (("offload=params", "offload.param_dtype=bfloat16"),
                                          "bf16")}
    rows = []
    for name, (overrides, precision) in variants.items():
        tag = name.split(" ")[0].replace("=", "-")
        code, host, secs, out = recipe_run(work / f"{tag}_cpu", steps, timeout / 4, *overrides,
                                        "hetero.device=cpu")
        if code != 0:
            rows.append(Row(f"recipe {name} (host)", "FAIL", last_line(out, "Error"), secs))
            continue
        if not has_device:
            rows.append(Row(f"recipe {name}", "SKIP", f"no accelerator; on the host: loss "
                            f"{host[1]:.4f} -> {host[steps]:.4f} in {steps} steps", secs))
            continue
        code, dev, more, out = recipe_run(work / f"{tag}_dev", steps, timeout / 4, *overrides)
        if code != 0 or set(dev) != set(host):
            rows.append(Row(f"recipe {name}", "FAIL", last_line(out, "Error"), secs + more))
            continue
        worst = max(abs(dev[s] - host[s]) / abs(host[s]) for s in host)
        rows.append(Row(f"recipe {name}", "PASS" if worst <= TOLERANCE[precision] else "FAIL",
                        f"loss {dev[1]:.4f} -> {dev[steps]:.4f}; worst relative gap to the host "
                        f"{worst:.1e} (at most {TOLERANCE[precision]:.0e})", secs + more))
    return rows


# ------------------------------------------------------------------ the run
def plan(has_device: bool, steps: int, work: Path
         ) -> list[tuple[str, float, Callable[[float], list[Row]]]]:
    """(name, seconds it needs at most, run(timeout) -> rows) of every step, in priority
    order."""
    from device_check_multi import multi_device_rows

    def one(row: Callable[[float], Row]) -> Callable[[float], list[Row]]:
        return lambda timeout: [row(timeout)]
    return [
        ("marked tests", 150, one(lambda t: marked_tests(has_device, t))),
        ("copy bandwidth", 20, one(lambda t: copy_bandwidth(has_device))),
        ("offloaded step", 180, one(lambda t: offloaded_step(has_device, t))),
        ("deterministic resume", 120, one(lambda t: deterministic_resume(has_device, steps,
                                                                         work, t))),
        ("recipe against the host", 160,
         lambda t: recipe_against_the_host(has_device, steps, work, t)),
        ("two or more devices", 240, lambda t: multi_device_rows(steps, work, t)),
    ]


def run_all(budget: Budget, has_device: bool, steps: int, work: Path) -> list[Row]:
    rows = [environment()]
    for name, need, run in plan(has_device, steps, work):
        left = budget.left()
        if left < min(need, 30):
            rows.append(Row(name, "SKIP", f"not run: {left:.0f} s of the budget left"))
            continue
        rows += run(min(need, left))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) /
                        "device_check.md")
    parser.add_argument("--steps", type=int, default=20, help="recipe steps per run (even)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds in all")
    args = parser.parse_args()
    budget = Budget(args.budget)
    with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
        rows = run_all(budget, hd.has_accelerator(), args.steps, Path(tmp))
    text = table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text, end="")
    print(f"written to {args.out} ({args.budget - budget.left():.0f} s)")
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
