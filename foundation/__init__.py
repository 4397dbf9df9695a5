"""The layer beneath ``hetero`` and ``parallel``: what both use and neither owns.

So far: ``foundation.errors`` (``CollectiveError`` and ``collective_guard``, which the parameter
server in ``hetero.nn`` and every distributed mode in ``parallel`` raise). Nothing here imports
``hetero`` or ``parallel``; ``hetero`` imports nothing from ``parallel``.
"""
