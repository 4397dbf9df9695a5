"""Where a model's values come from: deferred (meta-device) initialization and checkpoint loading.

``deferred_init.py`` records a model built on the meta device and gives each rank storage and
values for only what it holds, after the split and sharding (``deferred_hooks.py``,
``deferred_modes.py``, ``deferred_spmd.py``: per mode); ``loading.py`` fills them (or a model
with values) from a local checkpoint, each rank reading its block (``files.py`` reads the
formats, ``match.py`` matches the names and shapes).
"""
