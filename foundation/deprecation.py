"""One way to retire a public name: the old spelling keeps working for a release and says what
replaces it.

The project's promise (DEVELOPERS.md): a renamed or moved name keeps the old one for a release,
with a ``DeprecationWarning`` that names the new spelling, and a test calls the old one. Every
such door goes through :func:`warn_deprecated`, so the message has one form and a search for it
finds every door to close in the next release; a package whose names moved into submodules
declares them once with :func:`moved_names` (PEP 562's module ``__getattr__``, which also serves
``from package import name``), and one whose modules moved into subpackages declares those with
:func:`moved_modules`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import finder that answers a moved module's old name with the module at its new one
    (the same object, so classes and state are shared), with a deprecation warning.

    Written by hand because importlib has no alias: a module installed in ``sys.modules`` under
    two names would skip the warning, and a stub file per old name is the clutter a move
    removes."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)
        self._specs: dict[str, Any] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.moved:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> Any:
        # warnings skips importlib's own frames: stacklevel 2 is the importing line
        warn_deprecated(f"module {spec.name}", f"{self.moved[spec.name]}", stacklevel=2)
        module = importlib.import_module(self.moved[spec.name])
        self._specs[spec.name] = module.__spec__  # the import system sets the alias's next
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__)


def moved_modules(package: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """Old module names of ``package`` (short name -> the new dotted path) that keep working
    for a release: ``import package.old`` and ``from package.old import name`` through an import
    finder, ``package.old`` as an attribute through the returned ``__getattr__`` (chain it with
    :func:`moved_names`'s); each warns with the new spelling."""
    sys.meta_path.insert(0, _MovedModules({f"{package}.{old}": new for old, new in moved.items()}))

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warn_deprecated(f"module {package}.{name}", moved[name])
        return importlib.import_module(moved[name])

    return __getattr__
