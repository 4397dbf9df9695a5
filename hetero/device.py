"""``hetero.device`` is :mod:`foundation.device`: the device layer sits beneath ``hetero`` and
``parallel`` (both ask it what "cpu" and "device" mean), and hetero's users keep reaching it under
this name. The module object is the same, so ``hetero.device.X`` and ``foundation.device.X`` are
one attribute (a test's ``monkeypatch`` of either reaches both)."""

import sys

from foundation import device as _device

sys.modules[__name__] = _device
