"""Parameters and gradients on disk (``OffloadPolicy(params="disk")``): they rest in a mapped
scratch file, and host memory holds only the pages of the layers in flight."""

from __future__ import annotations

import os
import re

import pytest
import torch

from hetero.offload import OffloadPolicy, apply_offload
from hetero.offload.mapped_file import MappedFile
from recipes.gpt import GPT


def _mapped_rss(fragment: str) -> int:
    """Resident bytes of this process's mappings of files whose path holds ``fragment``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = fragment in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(64, d_model=256, n_layer=6, n_head=4, block_size=32)


def test_weights_and_gradients_rest_in_the_file_and_only_the_layers_in_flight_are_paged_in(
        tmp_path):
    model = _model()
    done = apply_offload(model, OffloadPolicy(params="disk", optimizer="host", path=tmp_path))
    opt = done.optimizer(model.parameters(), lr=1e-3)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing to leave behind
    mapping = str(tmp_path)
    layer = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    root = sum(p.numel() * 4 for p in model.parameters()) - len(model.blocks) * layer
    slack = 2 * 4096 * sum(1 for _ in model.parameters())  # a partly used page per tensor
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        _, loss = model(x, x)
        # forward: the root (embeddings, final norm) and the last layer are still in use
        assert _mapped_rss(mapping) <= root + 2 * layer + slack
        loss.backward()
        assert _mapped_rss(mapping) <= slack  # every layer let go of, gradients landed
        assert all(p.grad is not None and p.grad.data_ptr() == done.params.homes[id(p)]
                   .grad_slot.data_ptr() for p in model.parameters())  # in the file
        opt.step()
        opt.zero_grad()
    assert _mapped_rss(mapping) >= 6 * layer  # the step paged the weights in: a real measure
    assert all(p.data_ptr() == done.params.homes[id(p)].host.data_ptr()
               for p in model.parameters())


def test_the_disk_optimizer_lets_the_pages_go_as_it_steps(tmp_path):
    model = _model()
    done = apply_offload(model, OffloadPolicy(params="disk", optimizer="disk", path=tmp_path))
    opt = done.optimizer(model.parameters(), lr=1e-3, chunk_mb=1)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    model(x, x)[1].backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    # every weight and gradient was read and every weight written, and none stays paged in
    assert _mapped_rss(str(tmp_path)) <= 4096 * 2 * sum(1 for _ in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
               if p.grad is not None and p.grad.abs().sum() > 0)
    opt.close()


def test_a_gradient_accumulates_in_its_file_slot(tmp_path):
    model, twin = _model(), _model()
    apply_offload(model, OffloadPolicy(params="disk", optimizer="host", path=tmp_path))
    apply_offload(twin, OffloadPolicy(params="host", optimizer="host"))
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):  # no zero_grad: the sums of three backwards
        x = torch.randint(0, 64, (2, 32), generator=gen)
        for m in (model, twin):
            m(x, x)[1].backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_a_meta_model_is_made_straight_in_the_file_tensor_by_tensor(tmp_path):
    torch.manual_seed(0)
    want = GPT(64, d_model=256, n_layer=2, n_head=4, block_size=32)
    with torch.device("meta"):
        model = GPT(64, d_model=256, n_layer=2, n_head=4, block_size=32)
    names = []

    def init(name: str, tensor: torch.Tensor) -> None:
        names.append(name)
        tensor.copy_(want.get_parameter(name))

    done = apply_offload(model, OffloadPolicy(params="disk", optimizer="host", path=tmp_path),
                         init=init)
    assert names == [n for n, _ in want.named_parameters()]  # each once, a tied one too
    assert model.lm_head.weight is model.tok_emb.weight
    assert all(p.data_ptr() == done.params.homes[id(p)].host.data_ptr()
               for p in model.parameters())
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x, x)[1], want(x, x)[1])


def test_a_meta_model_without_init_or_with_meta_buffers_is_refused(tmp_path):
    with torch.device("meta"):
        model = GPT(64, d_model=32, n_layer=2, n_head=4, block_size=8)
    policy = OffloadPolicy(params="disk", optimizer="host", path=tmp_path)
    with pytest.raises(ValueError, match="on the meta device; materialise the model first or "
                                         "give init="):
        apply_offload(model, policy)
    model.blocks[0].register_buffer("scale", torch.empty(1, device="meta"))
    with pytest.raises(ValueError, match="buffer blocks.0.scale is on the meta device"):
        apply_offload(model, policy, init=lambda name, t: None)


def test_the_file_is_refused_where_it_cannot_be_made(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        MappedFile(tmp_path / "missing", "x.bin", [(torch.Size([4]), torch.float32)])
    (tmp_path / "taken.bin").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match="writes only files it creates"):
        MappedFile(tmp_path, "taken.bin", [(torch.Size([4]), torch.float32)])
    assert (tmp_path / "taken.bin").read_bytes() == b"someone else's"
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="not writable"):
            MappedFile(tmp_path / "ro", "x.bin", [(torch.Size([4]), torch.float32)])


def test_values_survive_being_let_go_of(tmp_path):
    file = MappedFile(tmp_path, "v.bin", [(torch.Size([3, 5000]), torch.float32),
                                         (torch.Size([7]), torch.bfloat16)])
    a, b = file.tensors
    a.copy_(torch.arange(15000.0).view(3, 5000))
    b.fill_(1.5)
    file.release([0, 1])
    assert torch.equal(a, torch.arange(15000.0).view(3, 5000)) and bool((b == 1.5).all())
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
