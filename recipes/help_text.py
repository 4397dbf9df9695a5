"""The config groups a recipe's ``--help`` lists: the option files of ``conf/``, without the typed
schemas (``gpt_schema``, ``train_schema``, ...) that ``recipes/config_schema.py`` stores beside
them in Hydra's ConfigStore. Hydra lists every ConfigStore entry of a group as an option and has
no way to hide one, so the recipes' help template (``hydra.help.template`` in ``conf/*.yaml``)
shows this listing, through the ``hp.config_groups`` resolver, instead of ``$APP_CONFIG_GROUPS``.
The format is Hydra's own: ``group: option, option``. ``conf/strategy/`` holds strategy files
for ``parallel.strategy``, not a config group, and is listed as such.
"""

from __future__ import annotations

from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"
#: directories of conf/ that hold files a setting names, not config groups
NOT_GROUPS = {"strategy": "parallel.strategy"}


def config_groups(conf: Path = CONF) -> str:
    """``group: a, b`` per line for every config group directory under ``conf``."""
    lines, files = [], []
    for group in sorted(p for p in conf.rglob("*") if p.is_dir()):
        name = group.relative_to(conf).as_posix()
        options = ", ".join(sorted(p.stem for p in group.glob("*.yaml")))
        if name in NOT_GROUPS:
            files.append(f"({NOT_GROUPS[name]}=NAME picks one of: {options})")
        elif options:
            lines.append(f"{name}: {options}")
    return "\n".join(lines + files)
