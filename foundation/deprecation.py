"""One way to retire a public name: the old spelling keeps working for a release and says what
replaces it.

The project's promise (DEVELOPERS.md): a renamed or moved name keeps the old one for a release,
with a ``DeprecationWarning`` that names the new spelling, and a test calls the old one. Every
such door goes through :func:`warn_deprecated`, so the message has one form and a search for it
finds every door to close in the next release; a package whose names moved into submodules
declares them once with :func:`moved_names` (PEP 562's module ``__getattr__``, which also serves
``from package import name``).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a spelling the caller used) is deprecated in favour of ``new``;
    ``stacklevel`` points at the caller's caller by default (the user's line)."""
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=stacklevel)


def moved_names(package: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name in ``moved`` (name -> the module it
    now lives in) is imported from its new home, with a deprecation warning; any other missing
    name raises ``AttributeError`` as usual."""

    def __getattr__(name: str) -> Any:
        home = moved.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warn_deprecated(f"{package}.{name}", f"{home}.{name}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
