"""Training settings (issue 28): trainer.precision, trainer.compile, trainer.keep_last, and the
refusals of combinations that cannot work, each named before any work starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero.optim import LossScaler
from recipe_helpers import compose_train, losses_of, train_in_process
from recipes.checkpoint_integrity import write_checksums
from recipes.checkpoint_retention import foreign_checkpoints, prune_checkpoints
from recipes.config_schema import check_config
from recipes.gpt import lm_loss
from recipes.run_settings import check_run_settings

FP32 = ["parallel=none", "trainer.max_steps=4"]


def _refused(overrides: list[str], match: str) -> None:
    cfg = compose_train(overrides)
    with pytest.raises(ValueError, match=match):
        check_config(cfg)
        check_run_settings(cfg)


@pytest.mark.parametrize(("overrides", "match"), [
    (["trainer.precision=fp8"], r"trainer.precision=fp8 must be one of"),
    (["trainer.keep_last=0"], r"trainer.keep_last=0 must be >= 1"),
    (["offload=optimizer", "trainer.precision=fp16"],
     r"trainer.precision=fp16 with offload.param_dtype=bfloat16"),
    (["offload=optimizer", "offload.param_dtype=float16", "trainer.precision=bf16"],
     r"trainer.precision=bf16 with offload.param_dtype=float16"),
    (["parallel=pipeline", "trainer.precision=fp16"], r"precision=fp16 needs loss scaling"),
    (["parallel=pipeline", "trainer.compile=true"], r"parallel=pipeline is not supported"),
    (["parallel=hybrid_3d", "trainer.compile=true"], r"parallel=hybrid_3d is not supported"),
    (["parallel=expert", "trainer.compile=true"], r"parallel=expert is not supported"),
    (["parallel.context_degree=2", "trainer.compile=true"], r"parallel=data is not supported"),
    (["hetero=embedding_on_cpu", "trainer.compile=true"], r"hetero.cpu_modules=.*captured graph"),
    (["model=gpt_moe", "trainer.compile=true"], r"MoE layers"),
])
def test_refusals_name_the_setting(overrides: list[str], match: str) -> None:
    _refused(overrides, match)


def test_loss_is_fp32_from_16_bit_logits() -> None:
    logits = torch.randn(2, 5, 11).to(torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5))
    loss = lm_loss(logits, targets)
    assert loss.dtype is torch.float32
    assert loss.item() == pytest.approx(lm_loss(logits.float(), targets).item(), rel=1e-6)


def _checkpoint(root: Path, step: int, run: str) -> Path:
    """A ``step_N`` directory with the manifest ``save_checkpoint`` writes for ``run``."""
    path = root / f"step_{step:06d}"
    path.mkdir()
    (path / "rank_00000.pt").write_bytes(b"state")
    write_checksums(path, run)
    return path


def test_keep_last_keeps_the_current_and_the_newest(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    for step in (1, 2, 3, 5, 8):
        _checkpoint(tmp_path, step, run)
    (tmp_path / "step_000009.tmp").mkdir()  # a save in flight: never touched
    # a run resumed from step 3 just wrote step 5 again? here: it wrote step 3
    removed = prune_checkpoints(tmp_path, 2, tmp_path / "step_000003", run)
    assert sorted(p.name for p in removed) == ["step_000001", "step_000002", "step_000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000003", "step_000008", "step_000009.tmp"]
    assert prune_checkpoints(tmp_path, 1, tmp_path / "step_000008", run) == [
        tmp_path / "step_000003"]


def test_keep_last_deletes_only_what_this_run_wrote(tmp_path: Path) -> None:
    """A user's folder named like a step, a symlinked step (it crashed the prune with OSError),
    an older version's checkpoint (no manifest) and a second run's checkpoints in the same
    directory: listed once at start-up, never deleted."""
    root, run, other = tmp_path / "checkpoints", str(tmp_path / "run"), str(tmp_path / "other")
    root.mkdir()
    notes = root / "step_000050"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine, not the run's")
    (root / "step_000060").symlink_to(_checkpoint(tmp_path, 60, run), target_is_directory=True)
    older = root / "step_000070"
    older.mkdir()
    foreign = [_checkpoint(root, 80, other), _checkpoint(root, 90, other)]
    assert foreign_checkpoints(root, run) == [notes, root / "step_000060", older, *foreign]
    ours = [_checkpoint(root, step, run) for step in (1, 2, 3)]
    assert sorted(prune_checkpoints(root, 1, ours[-1], run)) == ours[:2]
    assert sorted(p.name for p in root.iterdir()) == [
        "step_000003", "step_000050", "step_000060", "step_000070", "step_000080", "step_000090"]
    assert (notes / "notes.txt").read_text() == "mine, not the run's"
    assert (tmp_path / "step_000060" / "rank_00000.pt").exists()  # the link's target too
    assert prune_checkpoints(root, 1, foreign[-1], other) == [foreign[0]]


def _is_bf16_value(x: float) -> bool:
    return torch.tensor(x).to(torch.bfloat16).float().item() == x


@pytest.mark.slow
def test_precision_runs_log_fp32_losses_close_to_fp32(tmp_path: Path) -> None:
    """bf16 and fp16 autocast, and bf16 offloaded weights: every logged loss is an fp32 value
    (not bf16-quantized as before) within a 16-bit rounding of the fp32 run's."""
    cache, runs = tmp_path / "cache", {}
    for name, extra in (("fp32", []), ("bf16", ["trainer.precision=bf16"]),
                        ("fp16", ["trainer.precision=fp16"]), ("offload", ["offload=optimizer"]),
                        ("offload_fp16", ["offload=optimizer", "offload.param_dtype=float16",
                                          "trainer.precision=fp16"])):
        scalers = []
        train_in_process([*FP32, *extra], tmp_path / name, cache,
                         patch=lambda r, s=scalers: s.append(r.scaler))
        runs[name] = losses_of(tmp_path / name)
        if name == "fp16":
            assert isinstance(scalers[0], torch.amp.GradScaler)
        if name == "offload_fp16":
            assert isinstance(scalers[0], LossScaler)
    want = [runs["fp32"][s] for s in range(1, 5)]
    assert want[-1] < want[0]
    for name in ("bf16", "fp16", "offload", "offload_fp16"):
        got = [runs[name][s] for s in range(1, 5)]
        assert got == pytest.approx(want, rel=2e-3), name
        assert got != want, f"{name}: not 16-bit at all?"
        assert sum(_is_bf16_value(x) for x in got) <= 1, f"{name}: bf16-quantized losses {got}"


@pytest.mark.slow
def test_keep_last_leaves_k_checkpoints_and_resume_continues(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    keep = ["parallel=none", "optim.total_steps=8", "trainer.checkpoint_every=2",
            "trainer.keep_last=2"]
    run = tmp_path / "run"
    train_in_process([*keep, "trainer.max_steps=6"], run, cache)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000004", "step_000006"]
    summary = train_in_process([*keep, "trainer.max_steps=8", "trainer.resume_from=latest"],
                               run, cache)
    assert summary["steps"] == "7..8"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000006", "step_000008"]
    train_in_process(["parallel=none", "optim.total_steps=8", "trainer.max_steps=8"],
                     tmp_path / "straight", cache)
    straight = losses_of(tmp_path / "straight")
    assert losses_of(run) == pytest.approx(straight, rel=1e-6)


def test_a_deterministic_run_asks_for_deterministic_kernels_and_resumes_bitwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``trainer.deterministic=true``: torch's deterministic algorithms from before the first
    kernel (on a GPU also cuBLAS's fixed workspace: ``foundation.device``), so a resumed run's
    losses are the uninterrupted run's bit for bit (``make device-check`` runs it there)."""
    cache, flags = tmp_path / "cache", ["parallel=none", "optim.total_steps=4",
                                        "trainer.deterministic=true"]
    monkeypatch.setattr(torch, "use_deterministic_algorithms",
                        lambda on, **kw: asked.append(on))
    asked: list[bool] = []
    train_in_process([*flags, "trainer.max_steps=4", "trainer.checkpoint_every=2"],
                     tmp_path / "whole", cache)
    assert asked == [True]
    train_in_process([*flags, "trainer.max_steps=4", "trainer.resume_from="
                      f"{tmp_path / 'whole' / 'checkpoints' / 'step_000002'}"],
                     tmp_path / "resumed", cache)
    whole, resumed = losses_of(tmp_path / "whole"), losses_of(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == whole[s] for s in resumed)


def test_deterministic_kernels_get_their_device_environment(monkeypatch) -> None:
    import foundation.device as hd

    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, **kw: None)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(hd, "accelerator_type", lambda: "cuda")
    hd.use_deterministic_algorithms()
    assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own wins
    hd.use_deterministic_algorithms()
    assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.slow
@pytest.mark.timeout(480)  # a cold Inductor compile on a busy 2-core host: ~80-120 s
def test_compiled_run_equals_eager(tmp_path: Path) -> None:
    """torch.compile (Inductor) of the model under parallel=none: the same losses as eager to
    float rounding, and the checkpoint keys unchanged (it loads into an eager run)."""
    cache = tmp_path / "cache"
    args = ["parallel=none", "trainer.max_steps=3"]
    train_in_process(args, tmp_path / "eager", cache)
    train_in_process([*args, "trainer.compile=true"], tmp_path / "compiled", cache)
    eager, compiled = losses_of(tmp_path / "eager"), losses_of(tmp_path / "compiled")
    assert compiled == pytest.approx(eager, rel=1e-4)
    summary = train_in_process(["parallel=none", "trainer.max_steps=4",
                                "trainer.resume_from=latest"], tmp_path / "compiled", cache)
    assert summary["steps"] == "4..4"
