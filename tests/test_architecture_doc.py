"""docs/architecture.md is the map of the code: every module is on it, under its package.

A module added without a line there is a module a newcomer cannot find; this keeps the map
whole (issue 42: conventions a tool checks, not a habit)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("foundation", "hetero", "parallel", "recipes")


def _sections() -> dict[str, str]:
    """Each package's section of the map (from its ``## package/`` heading to the next)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    return {part.split("/", 1)[0]: part for part in parts if part.split("/", 1)[0] in PACKAGES}


def test_every_module_is_on_the_architecture_map():
    sections = _sections()
    assert set(sections) == set(PACKAGES)
    missing = [str(path.relative_to(ROOT))
               for package in PACKAGES
               for path in sorted((ROOT / package).rglob("*.py"))
               if path.name != "__init__.py"
               and f"`{path.name}`" not in sections[package]
               and f"{path.name} " not in sections[package]]
    assert not missing, f"modules missing from docs/architecture.md: {missing}"
