"""Layers whose parallel form the ``parallel`` package knows: :class:`MoE` (experts, router)."""

from parallel.nn.moe import MoE

__all__ = ["MoE"]
