"""Deprecated: ``hetero.compat`` moved to :mod:`foundation.compat`, the layer beneath ``hetero`` and
``parallel``. This name keeps working for one release, with a ``DeprecationWarning``."""

import sys
import warnings

from foundation import compat as _moved

warnings.warn("hetero.compat is deprecated: import foundation.compat", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
