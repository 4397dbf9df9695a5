"""The layer beneath ``hetero`` and ``parallel``: what both use and neither owns.

* ``foundation.device`` — the one module that knows concrete device names ("cuda", "npu"):
  accelerator discovery, logical names, the collective backend per device, pinned buffers,
  streams and events (``hetero.device`` is the same module, under hetero's name);
* ``foundation.compat`` — every torch private API the project relies on, version-checked;
* ``foundation.errors`` — ``CollectiveError`` and ``collective_guard``, raised by the parameter
  server and every distributed mode;
* ``foundation.model_view`` — ``ModelView``, the base of every wrapper both packages return;
* ``foundation.trusted_checkpoint`` — DCP checkpoints read without running code from them (the
  recipes' resume and export, ``parallel``'s sharded loading).

Nothing here imports ``hetero`` or ``parallel``; ``hetero`` imports nothing from ``parallel``
(``tests/test_parallel_api.py`` checks both).
"""
