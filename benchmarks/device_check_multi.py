"""``make device-check``'s rows for a node of two or more accelerators: each parallel dimension
against its peer, every mode's losses against one device's, and a killed rank.

* the benchmarks, on every device of the node (``torchrun``): collectives' bus bandwidth against
  torch's, ``DataParallel`` against DDP, optimizer parallel level2/3 against FSDP2, tensor
  parallel against ``parallelize_module``, context parallel against torch's ``context_parallel``;
* the recipe's data, pipeline, semi-auto, optimizer-parallel and expert modes on every device,
  each against ``parallel=none`` on one device on the same global batch;
* a rank killed mid-run: the others end with a named failure within the collective timeout,
  not a hang.
"""

from __future__ import annotations

from pathlib import Path

from device_rows import Row, last_line, recipe_run, run_command, torchrun

import foundation.device as hd

#: script -> (its arguments, what the line with its figures holds)
BENCHMARKS = {
    "benchmarks/collectives.py": ([], ("bus bandwidth",)),
    "benchmarks/data_parallel.py": ([], ("median",)),
    "benchmarks/optimizer_parallel.py": ([], ("level3",)),
    "benchmarks/semi_auto.py": ([], ("|",)),
    "benchmarks/context_parallel.py": (["--lengths", "4096", "8192"], ("8192",)),
}
#: the recipe's modes checked against one device's losses (every mode feeds the same global
#: batch, so the losses agree to the reduction order's rounding)
MODES = {"data": ("parallel=data",),
         "pipeline": ("parallel=pipeline",),
         "semi_auto": ("parallel=semi_auto",),
         "optimizer level3": ("parallel=data", "parallel.enable_parallel_optimizer=true",
                              "parallel.optimizer_level=level3"),
         "expert": ("model=gpt_moe", "parallel=expert")}
LOSS_TOLERANCE = 2e-3


def multi_device_rows(steps: int, work: Path, timeout: float) -> list[Row]:
    count = hd.device_count() if hd.has_accelerator() else 0
    if count < 2:
        return [Row("two or more devices: each dimension against its peer, every mode's losses "
                    "against one device's, a killed rank", "SKIP",
                    f"{count} accelerator(s) on this machine: these need 2 or more")]
    share = timeout / (len(BENCHMARKS) + len(MODES) + 2)
    rows = [benchmark(script, count, share) for script in BENCHMARKS]
    rows += modes_against_one_device(count, steps, work, share)
    rows.append(killed_rank(count, steps, work, share))
    return rows


def benchmark(script: str, count: int, timeout: float) -> Row:
    args, keys = BENCHMARKS[script]
    code, out, secs = run_command([*torchrun(count), script, *args], timeout,
                                  {"OMP_NUM_THREADS": "1"})
    return Row(f"{script} on {count} devices", "PASS" if code == 0 else "FAIL",
               last_line(out, *keys), secs)


def modes_against_one_device(count: int, steps: int, work: Path, timeout: float
                             ) -> list[Row]:
    code, base, secs, out = recipe_run(work / "one_device", steps, timeout)
    if code != 0:
        return [Row("recipe on one device (the modes' reference)", "FAIL",
                    last_line(out, "Error"), secs)]
    rows = []
    for name, overrides in MODES.items():
        moe = "model=gpt_moe" in overrides
        reference = base
        if moe:  # its own one-device reference: the MoE model
            code, reference, more, out = recipe_run(work / "one_device_moe", steps, timeout,
                                                    "model=gpt_moe")
            secs += more
        code, got, more, out = recipe_run(work / f"mode_{name.replace(' ', '_')}", steps,
                                          timeout, *overrides, ranks=count)
        if code != 0 or set(got) != set(reference):
            rows.append(Row(f"recipe {name} on {count} devices", "FAIL",
                            last_line(out, "Error"), more))
            continue
        worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
        rows.append(Row(f"recipe {name} on {count} devices",
                        "PASS" if worst <= LOSS_TOLERANCE else "FAIL",
                        f"{steps} steps; worst relative gap to one device's losses {worst:.1e} "
                        f"(at most {LOSS_TOLERANCE:.0e})", more))
    return rows


def killed_rank(count: int, steps: int, work: Path, timeout: float) -> Row:
    """Rank 1 killed as step 3 begins: the job must end (not hang) within the collective
    timeout, the survivors naming the failure."""
    code, _, secs, out = recipe_run(work / "killed", steps, timeout, "parallel=data",
                                    "trainer.kill_at=[1,3]", "trainer.collective_timeout_s=60",
                                    ranks=count)
    named = any(word in out for word in ("CollectiveError", "rank 1", "exitcode"))
    ok = code not in (0, 124) and named
    return Row(f"rank 1 of {count} killed at step 3", "PASS" if ok else "FAIL",
               f"exit {code} after {secs:.0f} s: " + last_line(out, "Error", "rank"), secs)
