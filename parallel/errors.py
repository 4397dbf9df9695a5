"""``parallel.CollectiveError`` and ``collective_guard`` live in ``foundation.errors`` (the layer
beneath ``hetero`` and ``parallel``, so the parameter server in ``hetero.nn`` can raise them
without importing ``parallel``); this module keeps the import path."""

from foundation.errors import CollectiveError, collective_guard

__all__ = ["CollectiveError", "collective_guard"]
