"""Launch the training recipe the way a user does and read back what it logged.

Shared by every recipe test: ``run_recipe`` runs ``recipes/train.py`` on ``nproc`` ranks started
as torchrun starts them (or under torchrun itself) or as a plain ``python`` process with a tiny
model, ``train_in_process`` runs the same
recipe class in this process (one rank), ``losses_of`` reads the ``metrics.jsonl`` a run wrote
(checking that each step was logged once, by rank 0), and ``checkpoint_tensors`` reads back every
tensor of a DCP checkpoint so two runs can be compared bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import foundation.device as hd
from rank_pool import FRESH_ENV
from recipes import config_schema, run_dir

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
#: the same for ``model=hf`` (its sizes are the inline config's)
HF_TINY = ["model.block_size=32", "data.num_chars=100000", "data.global_batch_size=8",
           "optim.warmup_steps=2", "optim.lr=1e-2", "trainer.progress_bar=false",
           "trainer.max_steps=4"]
TINY = ["model.d_model=32", "model.n_layer=1", "model.n_head=2", "data.num_chars=100000",
        "data.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=1e-2",
        "trainer.progress_bar=false"]


#: ``foundation.compat``'s warning at every start on a torch older than the tested ones (the lent
#: GPU machines' 2.11): left out of the recipes' stderr, which tests compare line by line
#: (``test_torch_versions.py`` tests the warning itself)
QUIET_TORCH_VERSION = "ignore:hetero-parallel is tested on torch:RuntimeWarning"


def recipe_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repo root first on PYTHONPATH (the recipes are a
    package imported from there) and the untested-torch warning left out, plus ``extra``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), QUIET_TORCH_VERSION]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": warnings, **extra}


def run_recipe(args: list[str], nproc: int | None, run: Path, cache: Path,
               timeout: float = 150, tiny: list[str] = TINY, torchrun: bool = False,
               output: bool = False, launcher_args: list[str] = ()
               ) -> subprocess.CompletedProcess:
    """Run the recipe with ``tiny`` + ``args`` into run dir ``run``; assert it succeeded.

    ``nproc`` ranks (2, 4 or 8) run the recipe's ``@hydra.main`` entry with these command-line
    arguments in the test session's pooled gloo ranks (:func:`recipe_in_pooled_ranks`: no
    interpreter start and imports, ~3 s a launch on this 2-core machine); ``None`` runs it in
    the pooled plain process (no torchrun variables: ``python recipes/train.py`` alone).
    The pooled runs return what they printed to ``sys.stdout``; ``output=True`` (a test that
    reads stderr, or everything a process prints) starts processes instead: one
    plain ``python`` for ``None``, else as torchrun starts its workers (:func:`launch_ranks`:
    its environment, one process per rank, the others stopped when one fails) without
    torchrun's own agent, as do other rank counts; ``torchrun=True`` runs the real
    ``python -m torch.distributed.run`` (the tests of the command users type keep it), with
    ``launcher_args`` (``--max-restarts=1``). ``HETERO_TEST_FRESH_RANKS=1`` pools nothing."""
    env = recipe_env(OMP_NUM_THREADS="1")
    if nproc is not None and nproc > max(1, hd.device_count()):  # ranks would share a device:
        env[hd.ACCELERATOR_ENV] = "none"  # NCCL/HCCL refuse that, so they run over gloo
    argv = [*tiny, f"data.cache_dir={cache}", f"hydra.run.dir={run}", *args]
    script = [str(RECIPES / "train.py"), *argv]
    if nproc in (2, 4, 8) and not (torchrun or output):
        return recipe_in_pooled_ranks("train", argv, nproc, timeout)
    if nproc is None and not (output or os.environ.get(FRESH_ENV)):
        return recipe_in_pooled_ranks("train", argv, None, timeout)
    if nproc is None or torchrun:
        launcher = [sys.executable]
        if nproc is not None:
            launcher += ["-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={nproc}", *launcher_args]
        cmd = launcher + script
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    else:
        cmd = [f"<{nproc} ranks>", sys.executable, *script]
        proc = launch_ranks([sys.executable, *script], nproc, env, timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _recipe_rank(rank: int, world: int, recipe: str, argv: list[str]) -> str:
    """One rank of a recipe run in a pooled process: its ``@hydra.main`` entry reading
    ``argv`` as the command line, from the repository root as ``run_recipe``'s processes run.
    The pool gives the task torchrun's environment and a fresh seed, and destroys the process
    group afterwards (``rank_pool.py``). Returns what the run printed to ``sys.stdout`` (the
    summary, the console log)."""
    import contextlib
    import importlib
    import io

    os.chdir(ROOT)
    sys.argv = [str(RECIPES / f"{recipe}.py"), *argv]
    main = importlib.import_module(f"recipes.{recipe}").main
    # Hydra finds ``config_path`` from the script's file when the entry is ``__main__``'s (as
    # when the script runs), from the package otherwise, where ``../conf`` is no module
    main.__wrapped__.__module__ = "__main__"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        main()
    return printed.getvalue()


def recipe_in_pooled_ranks(recipe: str, argv: list[str], nproc: int | None, timeout: float
                           ) -> subprocess.CompletedProcess:
    """The recipe on ``nproc`` pooled ranks (``run_ranks``), or ``None``: in the pooled plain
    process, as ``python recipes/<recipe>.py`` runs alone (no torchrun variables); a failed
    rank fails the test with its traceback (Hydra prints the error to the test's captured
    stderr). ``stdout``: what the ranks printed to ``sys.stdout``, rank 0 first; ``stderr`` is
    not captured (``run_recipe(output=True)`` starts processes for a test that reads it)."""
    from distributed import _environment, run_ranks
    from rank_pool import run_pooled

    with _environment({"HYDRA_FULL_ERROR": "1", "PYTHONPATH": recipe_env()["PYTHONPATH"]}):
        if nproc is not None:
            printed = run_ranks(_recipe_rank, nproc, recipe, argv, timeout=timeout)
        else:
            printed = run_pooled(_recipe_rank, 1, (recipe, argv), timeout, None)
    return subprocess.CompletedProcess([f"<{nproc or 'plain'} pooled>", recipe, *argv], 0,
                                       "".join(printed), "")


def launch_ranks(cmd: list[str], nproc: int, env: dict[str, str], timeout: float
                 ) -> subprocess.CompletedProcess:
    """``cmd`` as ``nproc`` ranks on this host with torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_*``, ``MASTER_*``); as torchrun does, the first rank to fail stops
    the others. Returns the first failing rank's code (else 0) and every rank's output, rank 0
    first."""
    import tempfile

    from distributed import free_port, torchrun_env

    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        outs = [(Path(logs) / f"{r}.out", Path(logs) / f"{r}.err") for r in range(nproc)]
        procs = []
        for r, (out, err) in enumerate(outs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=stderr,
                                              env={**env, **torchrun_env(r, nproc, port)}))
        code, deadline = 0, time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    code = failed[0] if failed else -9
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        code = code or next((p.returncode for p in procs if p.returncode), 0)
        stdout = "".join(out.read_text() for out, _ in outs)
        stderr = "".join(err.read_text() for _, err in outs)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def losses_of(run: Path) -> dict[int, float]:
    """step -> loss from the run's metrics.jsonl (each step must appear once)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), "a step was logged twice (by two ranks?)"
    return {r["step"]: r["loss"] for r in records}


def compose_train(overrides: list[str] | None = None):
    """``conf/train.yaml`` composed with ``overrides``, as Hydra does for the recipe."""
    config_schema.register_configs()
    run_dir.register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides or [])


def train_in_process(args: list[str], run: Path, cache: Path, patch=None,
                     tiny: list[str] = TINY) -> dict[str, Any]:
    """The GPT recipe with ``tiny`` + ``args`` in this process (one rank); returns its summary.
    ``patch(recipe)`` may change the recipe after set-up (fault injection)."""
    from recipes.train import TrainRecipe

    cfg = compose_train([*tiny, f"data.cache_dir={cache}", *args])
    config_schema.check_config(cfg)
    recipe = TrainRecipe(cfg, run)
    try:
        recipe.setup()
        if patch is not None:
            patch(recipe)
        return recipe.train()
    finally:
        recipe.cleanup()


def checkpoint_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP checkpoint at ``path``, by flattened key (model and optimizer)."""
    out = tmp / f"{path.parent.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}")
        elif isinstance(value, torch.Tensor):
            flat[key] = value
    walk(torch.load(out, weights_only=False), "")
    return flat


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:8]}"


def assert_resumes_in_one_process(run: Path, args: list[str], cache: Path,
                                  want: dict[int, float]) -> None:
    """``run``'s step-2 checkpoint, resumed by one plain process with ``args``, trains steps 3
    and 4 with one process's losses ``want``."""
    resumed = run.parent / f"{run.name}_resumed"
    run_recipe([*args, "parallel=none",
                f"trainer.resume_from={run / 'checkpoints' / 'step_000002'}"], None, resumed,
               cache)
    again = losses_of(resumed)
    assert [again[3], again[4]] == pytest.approx([want[3], want[4]], rel=1e-5)


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    """A 4-step run that learned (the last loss below the first) with one process's losses."""
    assert sorted(got) == [1, 2, 3, 4] and got[4] < got[1]
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)],
                                                          rel=1e-5)
