"""The disk tier: ``DiskAdamW`` keeps master weights and moments in a scratch file, streams them a
chunk at a time, and updates exactly as torch's fused AdamW does — whatever the chunk size, with
parameters that skip steps, and across a checkpoint to and from the other tiers."""

from __future__ import annotations

import os

import pytest
import torch

from hetero.offload import DiskAdamW, OffloadPolicy, apply_offload
from hetero.offload.disk_file import ALIGN, ChunkFile, aligned_empty
from pipeline_helpers import batch, tiny_gpt

KW = dict(lr=1e-2, weight_decay=0.1)


def _train(make_opt, steps: int = 3, model=None, state=None, start: int = 0, skip=None):
    model = model or tiny_gpt(3)
    opt = make_opt(model.parameters())
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(step)
        _, loss = model(x, y)
        loss.backward()
        if skip is not None and step % 2:  # a parameter without a gradient this step
            skip(model).grad = None
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, model, opt


def _torch(params):
    return torch.optim.AdamW(params, fused=True, **KW)


@pytest.mark.parametrize("chunk_mb", [0.05, 1.0])  # chunks cutting through parameters, or one
def test_disk_adamw_equals_torch_fused_adamw_bit_for_bit(tmp_path, chunk_mb):
    skip = lambda m: m.blocks[1].mlp[0].weight  # noqa: E731
    want_losses, want, _, _ = _train(_torch, steps=4, skip=skip)
    losses, got, _, opt = _train(lambda p: DiskAdamW(p, path=tmp_path, chunk_mb=chunk_mb, **KW),
                                 steps=4, skip=skip)
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(list(tmp_path.iterdir())) == 1  # one state file for the one group
    opt.close()
    assert list(tmp_path.iterdir()) == []  # the run's file is gone, and only it


def test_the_state_file_holds_master_and_moments_and_memory_holds_four_chunks(tmp_path):
    model = tiny_gpt(3)
    numel = sum(p.numel() for p in model.parameters())
    opt = DiskAdamW(model.parameters(), path=tmp_path, chunk_mb=0.05, **KW)
    (file,) = tmp_path.iterdir()
    assert file.stat().st_size >= numel * 12  # FP32 master, exp_avg, exp_avg_sq
    space = opt._spaces[0]
    assert space.chunks >= 3 and sum(b.nbytes for b in opt._buffers) == 4 * 12 * space.chunk
    assert all(all(v.numel() <= 1 for v in entry.values())  # the rest is on disk
               for entry in opt.state.values())
    opt.close()


@pytest.mark.parametrize("first, then", [("disk", "torch"), ("torch", "disk"),
                                         ("host", "disk")])
def test_a_checkpoint_moves_between_the_tiers(tmp_path, first, then):
    makers = {"disk": lambda p: DiskAdamW(p, path=tmp_path, chunk_mb=0.05, **KW),
              "torch": _torch,
              "host": lambda p: apply_offload(tiny_gpt(1), OffloadPolicy(optimizer="host"))
              .optimizer(p, **KW)}
    want_losses, want, _, _ = _train(_torch, steps=4)
    losses, _, model, opt = _train(makers[first], steps=2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    more, got, _, _ = _train(makers[then], steps=2, state=state, start=2)
    assert losses + more == pytest.approx(want_losses, rel=1e-6)
    if {first, then} <= {"disk", "torch"}:  # the same fused kernel: the same bits
        assert losses + more == want_losses
        assert all(torch.equal(got[k], want[k]) for k in want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_16_bit_parameters_keep_an_fp32_master_on_disk(tmp_path):
    model = tiny_gpt(2)
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    model.bfloat16()
    opt = DiskAdamW(model.parameters(), path=tmp_path, chunk_mb=0.05, **KW)
    state = opt.state_dict()["state"]  # before a step: step 0, zero moments, the masters
    assert all(e["step"] == 0 and not e["exp_avg"].any() for e in state.values())
    x, y = batch(0)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    masters = [s["fp32_master"] for s in opt.state_dict()["state"].values()]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not torch.equal(masters[0].bfloat16().float(), masters[0])  # not the rounded copy
    del fp32
    opt.close()


def test_the_chunk_file_reads_what_it_wrote_and_never_overwrites(tmp_path):
    chunk = 2 * ALIGN
    file = ChunkFile(tmp_path / "f.bin", chunks=3, chunk_bytes=chunk)
    out = [aligned_empty(chunk // 4) for _ in range(3)]
    for i, buffer in enumerate(out):
        buffer.fill_(float(i + 1))
        file.write(i, buffer).result()
    back = aligned_empty(chunk // 4)
    for i in (2, 0, 1):
        file.read(i, back).result()
        assert torch.equal(back, out[i])
    with pytest.raises(FileExistsError, match="writes only files it creates"):
        ChunkFile(tmp_path / "f.bin", chunks=1, chunk_bytes=ALIGN)
    with pytest.raises(ValueError, match="must be a multiple of"):
        ChunkFile(tmp_path / "g.bin", chunks=1, chunk_bytes=100)
    file.close()
    assert not (tmp_path / "f.bin").exists()
    (tmp_path / "theirs.bin").write_text("someone else's")
    DiskAdamW(tiny_gpt(1).parameters(), path=tmp_path).close()
    assert [p.name for p in tmp_path.iterdir()] == ["theirs.bin"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(path="/nonexistent/dir"), "is not a directory"),
    (dict(chunk_mb=0), "chunk_mb must be a number > 0"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiskAdamW(tiny_gpt(1).parameters(), **{"path": tmp_path, **kwargs})
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".bin"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(optimizer="disk"), "give path="),
    (dict(optimizer="host", path="/tmp"), "is where params='disk' and optimizer='disk' keep"),
    (dict(optimizer="disk", path="/tmp", ratio=0.5), "keeps all of it on disk"),
])
def test_a_disk_policy_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadPolicy(**kwargs)
    assert os.path.isdir("/tmp")


@pytest.mark.parametrize("flat", [False, True])  # the recipes' checkpoints flatten
def test_torch_distributed_checkpoint_state_dicts_leave_the_run_unchanged(tmp_path, flat):
    """DCP's get/set_state_dict run a zero-gradient "initialise the state" step on an optimizer
    whose ``state`` is empty, and read each parameter's state keys from ``optimizer.state``;
    DiskAdamW's names every key and is never empty, so saving and loading mid-run change
    nothing."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    want_losses, want, _, _ = _train(_torch, steps=4)
    losses, _, model, opt = _train(lambda p: DiskAdamW(p, path=tmp_path, **KW), steps=2)
    opt.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    saved = copy.deepcopy(optim_sd)
    fresh = DiskAdamW(model.parameters(), path=tmp_path, **KW)  # a resume: a new optimizer
    set_state_dict(model, fresh, model_state_dict=model_sd, optim_state_dict=saved,
                   options=options)
    opt.close()
    opt = fresh
    more, got, _, _ = _train(lambda p: opt, steps=2, model=model, start=2)
    assert losses + more == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_saves_from_the_state_file_and_loads_into_it(tmp_path):
    """The state dict's tensors are the state's arrays in the file, mapped: DCP saves from them
    and loads into them (the file holds the loaded state before ``load_state_dict`` runs), and
    the run resumed that way equals the uninterrupted one bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    make = lambda d: lambda p: DiskAdamW(p, path=d, chunk_mb=0.05, **KW)  # noqa: E731
    want_losses, want, _, _ = _train(_torch, steps=4)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    losses, _, model, opt = _train(make(tmp_path / "a"), steps=2)
    model_sd, optim_sd = get_state_dict(model, opt, options=flat)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "ckpt",
             no_dist=True)
    saved = {k: v.clone() for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    opt.close()

    model = tiny_gpt(3)
    fresh = make(tmp_path / "b")(model.parameters())
    model_sd, optim_sd = get_state_dict(model, fresh, options=flat)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "ckpt",
             no_dist=True)
    now = get_state_dict(model, fresh, options=flat)[1]  # read from the file again
    moments = [k for k in saved if "exp_avg" in k or "fp32_master" in k]
    assert moments and all(torch.equal(now[k], saved[k]) for k in moments)
    set_state_dict(model, fresh, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=flat)
    more, got, _, _ = _train(lambda p: fresh, steps=2, model=model, start=2)
    assert losses + more == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh.close()


def test_a_directory_without_room_is_refused_naming_the_bytes(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**6, 10**6 - 4096, 4096))
    with pytest.raises(ValueError, match=rf"{tmp_path} has 4096 bytes free, and the optimizer "
                                         rf"state needs \d+"):
        DiskAdamW(tiny_gpt(2).parameters(), path=tmp_path)
    assert list(tmp_path.iterdir()) == []


_LIMITED = """
import resource, signal, sys, torch
from hetero.offload import DiskAdamW
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
try:
    DiskAdamW([torch.nn.Parameter(torch.zeros(100_000))], path=sys.argv[1])
except OSError as err:
    print("refused:", err)
"""


@pytest.mark.slow
def test_a_disk_that_cannot_hold_the_state_fails_at_start_not_mid_run(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LIMITED, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert "refused: " in done.stdout and "cannot reserve" in done.stdout, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # the partial file is gone


_KILLED = """
import os, sys, torch
from hetero.offload import DiskAdamW
opt = DiskAdamW([torch.nn.Parameter(torch.zeros(1000))], path=sys.argv[1])
print("ready", flush=True)
os.kill(os.getpid(), 9)
"""

_LIVE = """
import sys, time, torch
from hetero.offload import DiskAdamW
opt = DiskAdamW([torch.nn.Parameter(torch.zeros(1000))], path=sys.argv[1])
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_killed_runs_files_are_removed_at_the_next_start_and_a_live_runs_kept(tmp_path):
    import subprocess
    import sys

    from hetero.offload.disk_adam import PREFIX

    live = subprocess.Popen([sys.executable, "-c", _LIVE, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "ready"
        killed = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)],
                                capture_output=True, text=True, timeout=120)
        assert killed.returncode == -9 and "ready" in killed.stdout
        assert len(list(tmp_path.glob(f"{PREFIX}*"))) == 2  # the killed run's and the live one's
        opt = DiskAdamW(tiny_gpt(1).parameters(), path=tmp_path)
        names = {p.name.split(".")[3] for p in tmp_path.glob(f"{PREFIX}*")}
        assert names == {str(live.pid), str(os.getpid())}  # the dead one's is gone
        opt.close()
    finally:
        live.kill()
        live.wait()


def test_the_disk_tier_equals_the_host_tier_bit_for_bit(tmp_path):
    from hetero.optim import OffloadAdamW

    want_losses, want, _, _ = _train(lambda p: OffloadAdamW(p, **KW), steps=4)
    losses, got, _, opt = _train(lambda p: DiskAdamW(p, path=tmp_path, chunk_mb=0.05, **KW),
                                 steps=4)
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    opt.close()
