"""Faults a user runs into with the GPT recipe, each refused with an error that names the cause.

Corrupted checkpoint files, resumes into a different model, impossible config values, non-finite
losses and states, and resumes that must reproduce the uninterrupted run bit for bit (one
process here, in-process; the multi-rank combinations are in test_recipe_resume.py).
"""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException
from torch.distributed.checkpoint.state_dict import StateDictOptions

import parallel
from recipe_helpers import (
    RECIPES,
    ROOT,
    assert_bitwise_equal,
    checkpoint_tensors,
    compose_train,
    losses_of,
    recipe_env,
    train_in_process,
)
from recipes import checkpoint, config_schema, optim
from recipes.base import NonFiniteLossError
from recipes.checkpoint_integrity import CheckpointError
from recipes.gpt import GPT


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


# ----------------------------------------------------------------------------- config values


@pytest.mark.parametrize("overrides, message", [
    (["optim.grad_clip=-1"], "optim.grad_clip=-1.0 must be > 0"),  # was gradient ascent, rc 0
    (["trainer.checkpoint_every=0"], "trainer.checkpoint_every=0 must be >= 1"),  # ZeroDivision
    (["trainer.log_every=0"], "trainer.log_every=0 must be >= 1"),  # ZeroDivisionError
    (["trainer.max_steps=-5"], "trainer.max_steps=-5 must be >= 1"),  # silently nothing
    (["optim.warmup_steps=-3"], "optim.warmup_steps=-3 must be >= 0"),  # warm-up skipped
    (["optim.lr=-0.1"], "optim.lr=-0.1 must be >= 0"),
    (["optim.betas=[0.9,1.0]"], r"optim.betas=\[0.9, 1.0\] each value must be < 1"),
    (["optim.total_steps=0"], "optim.total_steps=0 must be >= 1"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be <= 1"),
    (["model.dropout=1.5"], "model.dropout=1.5 must be < 1"),
    (["model.n_head=5"], "model.d_model=192 must be a multiple of n_head=5"),
    (["data.global_batch_size=0"], "data.global_batch_size=0 must be >= 1"),
    (["offload=optimizer", "offload.param_dtype=float32"],
     "offload.param_dtype=float32 must be one of"),
    (["offload=optimizer", "hetero.offload_bucket_mb=0"],
     "hetero.offload_bucket_mb=0.0 must be > 0"),
    (["offload=optimizer", "hetero.host_threads=0"], "hetero.host_threads=0 must be >= 1"),
    (["parallel=semi_auto", "parallel.tensor_degree=0"],
     "parallel.tensor_degree must be at least 1, got 0"),
    (["trainer.on_nonfinite_loss=ignore"], "trainer.on_nonfinite_loss=ignore must be one of"),
    # issue 29: a field's own rule runs before the cross-check that divides by it (was a bare
    # ZeroDivisionError), and no number is NaN or infinite (optim.lr=inf trained a step)
    (["model.n_head=0"], r"^config value\(s\) out of range: model.n_head=0 must be >= 1$"),
    (["optim.lr=inf"], r"optim.lr=inf must be finite \(got inf\)"),
    (["optim.lr=nan"], r"optim.lr=nan must be a number \(got nan\)"),
    (["optim.weight_decay=-inf"], r"optim.weight_decay=-inf must be finite"),
    (["optim.betas=[0.9,inf]"], r"optim.betas=\[0.9, inf\] each value must be finite"),
    (["model.capacity_factor=inf"], r"model.capacity_factor=inf must be finite"),
    (["parallel.max_device_memory=nan"], r"parallel.max_device_memory=nan must be a number"),
    # a sequence longer than the model's positions failed at the first forward, after set-up
    (["data.seq_len=1000"], r"data.seq_len=1000 exceeds model.block_size=64"),
    (["model=hf", "model.config={model_type:llama}", "data.seq_len=80"],
     r"data.seq_len=80 exceeds model.block_size=64"),
])
def test_each_impossible_config_value_is_refused(overrides, message):
    cfg = compose_train(overrides)  # Hydra's type checks let these through ...
    with pytest.raises(ValueError, match=message):
        config_schema.check_config(cfg)  # ... the schema's rules do not


def test_the_shipped_configs_pass_the_rules():
    for overrides in ([], ["optim=sgd"], ["offload=optimizer"], ["hetero=embedding_on_cpu"],
                      ["parallel=semi_auto"], ["parallel=none"]):
        config_schema.check_config(compose_train(overrides))
    with pytest.raises(ConfigCompositionException):
        compose_train(["trainer.on_nonfinite_loss=[1]"])  # a type error stays Hydra's


def test_schedule_and_clipping_helpers_refuse_impossible_values():
    with pytest.raises(ValueError, match="invalid warmup_steps=-3"):
        optim.warmup_cosine(-3, 10, 0.1)
    with pytest.raises(ValueError, match="invalid total_steps=0"):
        optim.warmup_cosine(0, 0, 0.1)
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()
    with pytest.raises(ValueError, match="invalid max_norm=-1"):
        optim.backward_and_step(model, torch.optim.SGD(model.parameters()), model(
            torch.ones(1, 2)).sum(), grad_clip=-1.0)
    assert torch.equal(model.weight.grad, 2 * before)  # backward ran, nothing was clipped


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_bad_value_stops_the_cli_before_any_work(tmp_path):
    env = recipe_env()
    proc = subprocess.run(
        [sys.executable, str(RECIPES / "train.py"), "trainer.checkpoint_every=0",
         f"hydra.run.dir={tmp_path}/x", f"data.cache_dir={tmp_path}/data"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "trainer.checkpoint_every=0 must be >= 1" in proc.stderr
    assert not (tmp_path / "data").exists()  # no corpus generated, no model, no process group
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- checkpoints


def _gpt(d_model=16, n_layer=2, seed=0):
    torch.manual_seed(seed)
    model = GPT(40, d_model, n_layer, 2, 8, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 8)))[1].backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _save(tmp_path, model, opt, sched, step=1):
    parallel.init()
    return checkpoint.save_checkpoint(tmp_path / "ckpt", step, model, opt, sched,
                                      torch.device("cpu"))


def test_a_corrupted_chunk_inside_a_distcp_file_is_named(tmp_path):
    """4 KiB overwritten inside a .distcp, size unchanged, used to load: the loss went NaN, the
    run exited 0 and wrote a NaN checkpoint that became the latest."""
    path = _save(tmp_path, *_gpt(d_model=64))
    chunk = next(path.glob("*.distcp"))
    size = chunk.stat().st_size
    assert size > 16 << 10
    with open(chunk, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\x7f" * 4096)
    assert chunk.stat().st_size == size
    with pytest.raises(CheckpointError, match=f"{chunk.name} does not match its checksum"):
        checkpoint.load_checkpoint(path, *_gpt(d_model=64, seed=1), torch.device("cpu"))
    (path / "rank_00000.pt").unlink()
    with pytest.raises(CheckpointError, match="rank_00000.pt is missing"):
        checkpoint.load_checkpoint(path, *_gpt(d_model=64, seed=1), torch.device("cpu"))


def test_resume_into_a_different_model_is_refused_naming_the_parameters(tmp_path):
    """A 2-layer checkpoint resumed into a 1-layer model used to load the subset silently."""
    saved_model, *rest = _gpt(n_layer=2)
    path = _save(tmp_path, saved_model, *rest)
    with pytest.raises(CheckpointError, match=r"only in the checkpoint: model\.blocks\.1\."
                                              r".*trainer\.allow_partial_resume=true"):
        checkpoint.load_checkpoint(path, *_gpt(n_layer=1, seed=1), torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: model\.blocks\.2\."):
        checkpoint.load_checkpoint(path, *_gpt(n_layer=3, seed=1), torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"shape differs: .*model\.tok_emb\.weight: "
                                              r"checkpoint \(40, 16\) vs model \(40, 32\)"):
        checkpoint.load_checkpoint(path, *_gpt(d_model=32, seed=1), torch.device("cpu"))
    # the explicit opt-in loads what fits and leaves the rest as it was
    model, opt, sched = _gpt(n_layer=1, seed=1)
    fresh_head = model.ln_f.weight.detach().clone()
    assert checkpoint.load_checkpoint(path, model, opt, sched, torch.device("cpu"),
                                      allow_partial=True) == 1
    assert torch.equal(model.blocks[0].mlp[0].weight, saved_model.blocks[0].mlp[0].weight)
    assert torch.equal(model.ln_f.weight, saved_model.ln_f.weight)
    assert not torch.equal(fresh_head, saved_model.ln_f.weight)


def test_resume_into_another_optimizer_names_both(tmp_path):
    """An SGD checkpoint resumed into AdamW used to stop in DCP with a raw "Missing key ...
    exp_avg"; the other way round, "... momentum_buffer"."""
    model, _, _ = _gpt()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model(torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 8)))[1].backward()
    sgd.step()
    path = _save(tmp_path, model, sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0))
    with pytest.raises(CheckpointError, match=r"written by SGD \(optimizer state "
                                              r"momentum_buffer\), but this run's optimizer is "
                                              r"AdamW \(state exp_avg, exp_avg_sq, step; "):
        checkpoint.load_checkpoint(path, *_gpt(seed=1), torch.device("cpu"))
    adamw_path = _save(tmp_path / "adamw", *_gpt())
    model, _, _ = _gpt(seed=1)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"written by AdamW .* optimizer is SGD"):
        checkpoint.load_checkpoint(adamw_path, model, sgd,
                                   torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0),
                                   torch.device("cpu"))


def test_an_unwritable_checkpoint_dir_stops_before_the_first_step(tmp_path, cache):
    """trainer.checkpoint_dir=/proc/nope trained two steps and failed at the first save."""
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"trainer.checkpoint_dir=/proc/nope: /proc/nope is not "
                                         r"a writable directory on rank\(s\) \[0\]"):
        train_in_process(["parallel=none", "trainer.max_steps=2",
                          "trainer.checkpoint_dir=/proc/nope"], run, cache)
    assert not (run / "metrics.jsonl").exists() or losses_of(run) == []


def test_a_full_disk_at_a_save_fails_and_keeps_the_previous_checkpoint(tmp_path, cache,
                                                                        monkeypatch):
    """ENOSPC while the second checkpoint is written: the error says so, the half-written one
    never becomes the latest, and the run resumes from the first."""
    save = checkpoint._atomic_save

    def disk_full_at_step_2(obj, path):
        if "step_000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        save(obj, path)
    monkeypatch.setattr(checkpoint, "_atomic_save", disk_full_at_step_2)
    run = tmp_path / "run"
    args = ["parallel=none", "trainer.max_steps=3", "trainer.checkpoint_every=1"]
    with pytest.raises(OSError, match="No space left on device"):
        train_in_process(args, run, cache)
    assert checkpoint.latest_checkpoint(run / "checkpoints").name == "step_000001"
    monkeypatch.setattr(checkpoint, "_atomic_save", save)
    summary = train_in_process([*args, "trainer.resume_from=latest"], run, cache)
    assert summary["steps"] == "2..3"


def test_a_non_finite_state_is_never_written(tmp_path):
    model, opt, sched = _gpt()
    good = _save(tmp_path, model, opt, sched, step=1)
    with torch.no_grad():
        model.blocks[0].mlp[0].weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="holds NaN/Inf; refusing to write"):
        _save(tmp_path, model, opt, sched, step=2)
    assert checkpoint.latest_checkpoint(tmp_path / "ckpt") == good
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000001"]


# ----------------------------------------------------------------------------- the loop


def _nan_at_step(bad_step):
    def patch(recipe):
        forward = recipe.forward

        def poisoned(step):
            loss = forward(step)
            return loss * float("nan") if step == bad_step else loss
        recipe.forward = poisoned
    return patch


def test_a_non_finite_loss_stops_the_run_before_it_reaches_a_checkpoint(tmp_path, cache):
    run = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match="step 3: the loss is nan"):
        train_in_process(["parallel=none", "trainer.max_steps=5", "trainer.checkpoint_every=1"],
                         run, cache, patch=_nan_at_step(3))
    assert checkpoint.latest_checkpoint(run / "checkpoints").name == "step_000002"
    assert sorted(losses_of(run)) == [1, 2]


def test_on_nonfinite_loss_skip_skips_the_update(tmp_path, cache):
    args = ["parallel=none", "trainer.max_steps=4", "trainer.checkpoint_every=1",
            "trainer.on_nonfinite_loss=skip"]
    summary = train_in_process(args, tmp_path / "run", cache, patch=_nan_at_step(3))
    assert summary["skipped_steps"] == [3] and summary["steps"] == "1..4"
    ckpts = tmp_path / "run" / "checkpoints"
    two, three = (checkpoint_tensors(ckpts / f"step_00000{s}", tmp_path) for s in (2, 3))
    model_of = {k: v for k, v in two.items() if k.startswith("model.")}
    assert_bitwise_equal(model_of, {k: v for k, v in three.items() if k.startswith("model.")})


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_fused_optimizer_skips_a_non_finite_step_on_the_device(tmp_path, cache, policy):
    """With ``fused=True`` the update takes the flag on the device and the host reads it a step
    later (recipes/finite_guard.py): a skipped step leaves the weights and the optimizer state
    as they were; ``stop`` still ends the run before a checkpoint holds the step."""
    run = tmp_path / "run"
    args = ["parallel=none", "trainer.max_steps=4", "trainer.checkpoint_every=1",
            "+optim.optimizer.fused=true", f"trainer.on_nonfinite_loss={policy}"]
    if policy == "stop":
        with pytest.raises(NonFiniteLossError, match="step 3: the loss is nan"):
            train_in_process(args, run, cache, patch=_nan_at_step(3))
        assert checkpoint.latest_checkpoint(run / "checkpoints").name == "step_000002"
        return
    summary = train_in_process(args, run, cache, patch=_nan_at_step(3))
    assert summary["skipped_steps"] == [3] and summary["steps"] == "1..4"
    two, three = (checkpoint_tensors(run / "checkpoints" / f"step_00000{s}", tmp_path)
                  for s in (2, 3))
    kept = {k: v for k, v in two.items() if k.startswith(("model.", "optim.state"))}
    assert kept and any(k.startswith("optim.state") for k in kept)
    assert_bitwise_equal(kept, {k: three[k] for k in kept})


# ----------------------------------------------------------------------------- bitwise resume


@pytest.mark.parametrize("combination", [
    ["hetero=none"],
    ["hetero=embedding_on_cpu"],
    ["offload=optimizer", "hetero.offload_kernel=torch"],
    # fp16: the scaler's state (scale, clean-step count) moves from its start every step; a
    # resume that does not restore it replays overflows or grows the scale at another step (it
    # used to differ from step 12 on)
    ["offload=optimizer", "hetero.offload_kernel=torch", "offload.param_dtype=float16",
     "optim.lr=3e-2"],
], ids=["none", "embedding_on_cpu", "offload_bf16", "offload_fp16"])
def test_one_process_resume_is_bitwise(tmp_path, cache, combination):
    """parallel=none x every hetero config: a run resumed from step 3 ends with the same losses,
    weights, optimizer state (and loss-scaler state) as the run that went straight through."""
    same = ["parallel=none", "trainer.max_steps=6", "trainer.checkpoint_every=3", *combination]
    a, b = tmp_path / "a", tmp_path / "b"
    train_in_process(same, a, cache)
    train_in_process([*same, f"trainer.resume_from={a / 'checkpoints' / 'step_000003'}"], b,
                     cache)
    a_losses, b_losses = losses_of(a), losses_of(b)
    assert sorted(b_losses) == [4, 5, 6]
    assert [b_losses[s] for s in (4, 5, 6)] == [a_losses[s] for s in (4, 5, 6)]
    assert_bitwise_equal(checkpoint_tensors(a / "checkpoints" / "step_000006", tmp_path),
                         checkpoint_tensors(b / "checkpoints" / "step_000006", tmp_path))
    scaler = [torch.load(d / "checkpoints" / "step_000006" / "rank_00000.pt")["loss_scaler"]
              for d in (a, b)]
    assert scaler[0] == scaler[1]
    if "offload.param_dtype=float16" in combination:  # the state moved: restoring it matters
        # (the loss is fp32 now, so the first steps no longer overflow: the count of clean steps
        # since the last change of scale is what moved)
        assert scaler[0]["scale"] < 2.0**16 or scaler[0]["_growth_tracker"] == 6


def test_a_checkpoint_keyed_by_group_index_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before optimizer state was keyed by parameter name load as before."""
    model, opt, sched = _gpt()
    monkeypatch.setattr(checkpoint, "_FLAT", StateDictOptions())  # the older writer
    monkeypatch.setattr(checkpoint, "_with_tied_aliases", lambda model, sd: sd)
    path = _save(tmp_path, model, opt, sched)
    monkeypatch.undo()
    fresh, fresh_opt, fresh_sched = _gpt(seed=1)
    assert checkpoint.load_checkpoint(path, fresh, fresh_opt, fresh_sched,
                                      torch.device("cpu")) == 1
    assert torch.equal(fresh.ln_f.weight, model.ln_f.weight)
    assert all(torch.equal(a["exp_avg"], b["exp_avg"])
               for a, b in zip(fresh_opt.state.values(), opt.state.values(), strict=True))


def test_a_checkpoint_without_the_tied_head_name_still_loads(tmp_path, monkeypatch):
    """GPT's head got its own name (lm_head, tied to tok_emb); older checkpoints lack it."""
    model, opt, sched = _gpt()
    real = checkpoint.get_state_dict

    def older(*args, **kwargs):
        model_sd, optim_sd = real(*args, **kwargs)
        model_sd.pop("lm_head.weight")
        return model_sd, optim_sd
    monkeypatch.setattr(checkpoint, "get_state_dict", older)
    path = _save(tmp_path, model, opt, sched)
    monkeypatch.undo()
    fresh, fresh_opt, fresh_sched = _gpt(seed=1)
    checkpoint.load_checkpoint(path, fresh, fresh_opt, fresh_sched, torch.device("cpu"))
    assert torch.equal(fresh.tok_emb.weight, model.tok_emb.weight)
    assert fresh.lm_head.weight is fresh.tok_emb.weight
