"""Capture a model as an fx graph with ``torch.export`` (training IR), on fake tensors.

Why export: it captures real models that ``symbolic_trace`` cannot (HuggingFace models among
them), and every node carries ``meta["nn_module_stack"]``, which is how a node finds its innermost
tagged module. Why fake tensors: capture must not depend on where parameters live, nor cost their
memory. After the first placement the model's parameters sit on two devices, and tracing it for
a new input shape would mix devices inside single ops. So capture exports a private deep copy of
the model whose parameters and buffers are fake twins, all on the accelerator (the originals are
mapped to their twins in deepcopy's memo, so no tensor data is copied): the user's model is never
touched, another thread may keep using it while a capture runs, and a failed capture has nothing
to restore. Captures run one at a time (export keeps global state). The captured graph then gets
the real tensors back under the same names, and its higher-order regions are inlined or made
relocatable (``subgraphs``). A causal mask that export made explicit goes back to SDPA's
``is_causal``, as eager runs it (``causal``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sysconfig
import threading
import traceback
import warnings
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn

from foundation import device as hd
from foundation.compat import fake_tensor_mode, pytree, reparametrize_module
from hetero.placement import subgraphs
from hetero.placement.causal import restore_causal_attention

_NOT_USER_CODE = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"],
                  os.path.dirname(__file__))


# export keeps global state (fake-tensor mode, node-meta recording): captures run one at a time.
CAPTURE_LOCK = threading.RLock()


class CaptureError(RuntimeError):
    """The model could not be captured as a graph; the message names where and the fallback."""


@dataclasses.dataclass
class Captured:
    """A captured forward: the graph module (holding the model's real tensors) and its specs."""

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec


# Fake tensors (shapes, dtypes and a device, no storage) sit on the accelerator (the host when
# there is none), so Python that branches on ``tensor.device.type`` (transformers' MoE routing
# picks a CPU-only ``histc`` variant that way) takes the branch eager would take; meta tensors
# would steer it to a "meta" branch. export reuses the fake inputs' mode for the trace.
def _twins(model: nn.Module, mode: Any) -> dict[str, torch.Tensor]:
    twins: dict[str, torch.Tensor] = {}
    device = hd.resolve("device")
    # One twin per tensor: tied names (lm_head.weight = wte.weight) get it through tie_weights.
    with mode:
        for name, param in model.named_parameters():
            twins[name] = nn.Parameter(torch.empty_like(param, device=device),
                                       param.requires_grad)
        for name, buf in model.named_buffers():
            twins[name] = torch.empty_like(buf, device=device)
    return twins


def _twin(value: Any, mode: Any) -> Any:
    if isinstance(value, torch.Tensor):
        with mode:
            twin = torch.empty_like(value, device=hd.resolve("device"))
        return twin.requires_grad_(value.requires_grad)
    return value


class _ModuleStack:
    """Forward pre/post hooks that remember which module was running when capture failed."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        for path, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(path)))
            # No always_call: when forward raises, the failing module stays on the stack.
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, path: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(path or "<root>")
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _user_frame(err: BaseException) -> str:
    """The innermost frame of the failure that is not inside torch: the user's offending line."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_NOT_USER_CODE)]
    if not frames:
        return "unknown line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} `{(f.line or '').strip()}`"


def _restore_real_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """Point every ``get_attr`` of the captured graph at the model's own tensor of that name."""
    real = dict(model.named_parameters(remove_duplicate=False))
    real.update(model.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in real:
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        tensor = real[node.target]
        if isinstance(tensor, nn.Parameter):
            owner._parameters[attr] = tensor
        else:
            owner._buffers[attr] = tensor


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove export's input-guard call: the placed model keys captures by input signature."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
            if hasattr(gm, node.target):
                delattr(gm, node.target)
    gm.recompile()


def _private_copy(model: nn.Module, twins: dict[str, torch.Tensor]) -> nn.Module | None:
    """A copy of ``model`` whose parameters and buffers are ``twins``, or None if the model
    cannot be deep-copied. Capturing the copy never swaps the user's own tensors, so another
    thread using the model meanwhile sees nothing, and a failed capture has nothing to restore."""
    memo: dict[int, Any] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        memo[id(tensor)] = twins[name]
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # locks, open files, C handles: fall back to swapping under the lock
        return None


def _export(model: nn.Module, args: tuple, kwargs: dict, mode: Any
            ) -> torch.export.ExportedProgram:
    twins = _twins(model, mode)
    private = _private_copy(model, twins)
    stack = _ModuleStack(private if private is not None else model)
    try:
        with fx_traceback.preserve_node_meta():
            if private is not None:
                return torch.export.export(private, args, kwargs, strict=False)
            warnings.warn(
                f"hetero.place: {type(model).__name__} cannot be deep-copied, so it is captured "
                f"with its parameters swapped for fake twins; do not run it from another thread "
                f"while it is captured", stacklevel=4)
            with reparametrize_module(model, twins, tie_weights=True):
                return torch.export.export(model, args, kwargs, strict=False)
    except Exception as err:
        where = stack.stack[-1] if stack.stack else "<root>"
        raise capture_error(model, err, f"in module '{where}' at {_user_frame(err)}") from err
    finally:
        stack.remove()


def capture_error(model: nn.Module, err: BaseException, where: str) -> CaptureError:
    """The error every capture failure surfaces as: what failed, where, and the fallback."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return CaptureError(
        f"hetero.place could not capture {type(model).__name__} as a graph: "
        f"{type(err).__name__}: {first}\n  {where}\n"
        f"Fallback: hetero.place(model, mode='hooks') moves the inputs and outputs of tagged "
        f"modules with forward hooks instead (coarser: no graph split, no concurrency, but it "
        f"trains)."
    )


def capture(model: nn.Module, args: tuple, kwargs: dict) -> Captured:
    """Export ``model(*args, **kwargs)`` on fake twins of its tensors; raise CaptureError."""
    mode = fake_tensor_mode()
    fake_args, fake_kwargs = pytree.tree_map(lambda v: _twin(v, mode), (args, kwargs))
    with CAPTURE_LOCK:
        program = _export(model, fake_args, fake_kwargs, mode)
    try:
        gm = program.module()
        _restore_real_tensors(gm, model)
        _drop_guards(gm)
        subgraphs.inline_mode_regions(gm)
        subgraphs.rename_bodies(gm)
        subgraphs.drop_metadata_asserts(gm)  # first: they read the mask's intermediates
        restore_causal_attention(gm)
    except Exception as err:
        raise capture_error(model, err, "while preparing the captured graph") from err
    signature = program.module_call_graph[0].signature
    return Captured(gm, signature.in_spec, signature.out_spec)
