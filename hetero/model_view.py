"""Deprecated: ``hetero.model_view`` moved to :mod:`foundation.model_view`, the layer beneath
``hetero`` and ``parallel``. This name keeps working for one release, with a
``DeprecationWarning``."""

import sys
import warnings

from foundation import model_view as _moved

warnings.warn("hetero.model_view is deprecated: import foundation.model_view", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
