"""Host tables at rest in files (``EmbeddingLookup(disk_path=...)``, the parameter server's cold
rows on disk): the table is made in its file, its sparse optimizer's state is made in files
beside it, the run trains bit for bit like the in-memory table, a DCP checkpoint saves from the
files and loads back into them, and nothing is left in the directory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hetero.nn import EmbeddingLookup
from hetero.optim import FTRL, LazyAdam

VOCAB, DIM, STEPS = 5000, 8, 4
OPTIMIZERS = {"lazy_adam": (LazyAdam, dict(lr=1e-2)), "ftrl": (FTRL, dict(lr=0.1))}


def _mapped_ranges(directory) -> list[tuple[int, int]]:
    """The address ranges this process maps from files under ``directory`` (unlinked ones
    included)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if str(directory) in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def _in_files(t: torch.Tensor, directory) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi in _mapped_ranges(directory))


def _steps(table: EmbeddingLookup, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = torch.randint(0, VOCAB, (64, 3), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = (table(ids) - 0.5).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _run(name: str, disk_path=None) -> tuple[EmbeddingLookup, torch.optim.Optimizer]:
    torch.manual_seed(0)
    table = EmbeddingLookup(VOCAB, DIM, disk_path=disk_path)
    cls, kw = OPTIMIZERS[name]
    return table, cls([table.weight], **kw)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_table_on_disk_trains_like_one_in_memory_with_its_state_in_files(tmp_path, name):
    table, opt = _run(name)
    want = _steps(table, opt, range(STEPS))
    on_disk, disk_opt = _run(name, tmp_path)
    assert _steps(on_disk, disk_opt, range(STEPS)) == want
    assert torch.equal(on_disk.weight, table.weight)
    assert _in_files(on_disk.weight, tmp_path)
    state = disk_opt.state[on_disk.weight]
    assert all(torch.equal(state[k], v) for k, v in opt.state[table.weight].items())
    assert all(_in_files(v, tmp_path) for v in state.values() if v.shape == table.weight.shape)
    assert list(tmp_path.iterdir()) == []  # unlinked as soon as made: nothing to clean up


def test_a_checkpoint_saves_from_the_files_and_loads_back_into_them(tmp_path):
    table, opt = _run("lazy_adam")
    want = _steps(table, opt, range(2 * STEPS))
    (tmp_path / "tables").mkdir()
    table, opt = _run("lazy_adam", tmp_path / "tables")
    losses = _steps(table, opt, range(STEPS))
    model_sd, optim_sd = get_state_dict(table, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "ckpt",
             no_dist=True)
    del table, opt, model_sd, optim_sd

    table, opt = _run("lazy_adam", tmp_path / "tables")  # a resumed run
    _steps(table, opt, range(1))  # its state made (in files), then overwritten by the load
    model_sd, optim_sd = get_state_dict(table, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "ckpt",
             no_dist=True)
    set_state_dict(table, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    state = opt.state[table.weight]
    assert _in_files(table.weight, tmp_path / "tables")
    assert all(_in_files(v, tmp_path / "tables") for k, v in state.items() if k != "step")
    assert losses + _steps(table, opt, range(STEPS, 2 * STEPS)) == want


def test_a_state_dict_from_memory_loads_into_files(tmp_path):
    table, opt = _run("lazy_adam")
    _steps(table, opt, range(STEPS))
    on_disk, disk_opt = _run("lazy_adam", tmp_path)
    on_disk.load_state_dict(table.state_dict())
    disk_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as torch.load would give it
    state = disk_opt.state[on_disk.weight]
    assert all(_in_files(v, tmp_path) for k, v in state.items() if k != "step")
    assert _steps(on_disk, disk_opt, range(STEPS, 2 * STEPS)) == _steps(
        table, opt, range(STEPS, 2 * STEPS))


def test_a_device_table_on_disk_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="keeps a host table .target='CPU'. at rest in a file"):
        EmbeddingLookup(VOCAB, DIM, target="DEVICE", sparse=False, disk_path=tmp_path)


def test_the_benchmark_runs_the_disk_table_beside_the_memory_one(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "embedding.py"
    done = subprocess.run([sys.executable, str(bench), "--vocab", "20000", "--dim", "8",
                           "--batch", "64", "--fields", "4", "--steps", "2", "--dist", "zipf",
                           "--disk", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "table + LazyAdam state on disk" in done.stdout and "ratio" in done.stdout
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone
