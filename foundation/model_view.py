"""``ModelView``: the base of every wrapper this project returns (placed, data-parallel, ...).

A wrapper that *is* the model for parameters, buffers, submodules and attributes: the registries
are shared, not copied, so ``parameters()``, ``state_dict()`` keys and optimizers are exactly the
original's (no ``module.`` prefix), while the wrapper decides what ``forward`` does. As torch's
wrappers do, it exposes the wrapped model as ``.module`` and keeps ``train()``/``eval()`` in step
with it.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class ModelView(nn.Module):
    """An ``nn.Module`` that shares ``model``'s registries; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self.training = model.training
        object.__setattr__(self, "_model", model)  # not a submodule: keys stay unprefixed

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is None:
                raise
            return getattr(model, name)

    def train(self, mode: bool = True) -> ModelView:
        """Set train/eval on this view and on the wrapped model (its own flag included)."""
        super().train(mode)
        self._model.train(mode)
        return self

    @property
    def module(self) -> nn.Module:
        """The wrapped model, as ``DistributedDataParallel.module`` is."""
        return self._model

    @property
    def model(self) -> nn.Module:
        """The wrapped model (same tensors; alias of ``module``) — unless the model has a
        submodule named ``model`` (every HuggingFace causal LM's decoder), which this then is:
        the view answers attribute paths as the model does (``model.embed_tokens`` in a state
        dict's key is walked by ``getattr``)."""
        child = self._modules.get("model")
        return child if child is not None else self._model


def unwrapped(model: nn.Module) -> list[nn.Module]:
    """``model`` and every model it wraps, outermost first: the chain of :class:`ModelView`
    wrappers down to the user's own module (a data-parallel wrapper, the placed model, the
    model). One way to reach any of them whatever wrapped it, on any world size."""
    chain = [model]
    while isinstance(chain[-1], ModelView):
        chain.append(chain[-1]._model)
    return chain
