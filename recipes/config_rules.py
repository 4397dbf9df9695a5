"""Range rules for the config schemas, and the checks a recipe runs before any work starts.

A schema field says what its value must be with ``rule(default, ge=..., choices=...)`` (the rule
rides in the dataclass field's ``metadata``); a schema may add ``cross_check(cfg)`` for rules
that relate two fields. :func:`check_config` refuses unknown keys (added with Hydra's ``+``) and
every value out of range, naming each.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


@dataclass(frozen=True)
class Rule:
    """What a config value must be: bounds (``ge``/``gt``/``le``/``lt``), one of ``choices``,
    and for a list ``length`` and the same rule per item (``each``). None passes (optional)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    each: bool = False
    length: int | None = None
    # infinity is refused unless the field means it (a limit that may be "no limit")
    allow_inf: bool = False

    def broken_by(self, value: Any) -> str | None:
        """The rule ``value`` breaks, in words, or None."""
        if value is None:
            return None
        if self.each:
            if self.length is not None and len(value) != self.length:
                return f"must hold {self.length} values"
            return next((f"each value {why}" for v in value
                         if (why := dataclasses.replace(self, each=False).broken_by(v))), None)
        if self.choices is not None:
            return None if value in self.choices else f"must be one of {list(self.choices)}"
        if isinstance(value, float) and math.isnan(value):
            return "must be a number (got nan)"
        if isinstance(value, float) and math.isinf(value) and not self.allow_inf:
            return f"must be finite (got {value})"
        for limit, word, holds in ((self.ge, ">=", operator.ge), (self.gt, ">", operator.gt),
                                   (self.le, "<=", operator.le), (self.lt, "<", operator.lt)):
            if limit is not None and not holds(value, limit):
                return f"must be {word} {limit}"
        return None


_FINITE = Rule()  # the rule of a numeric field that declares none


def rule(default: Any = MISSING, **kwargs: Any) -> Any:
    """A dataclass field with ``default`` and the range rule ``Rule(**kwargs)``."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": Rule(**kwargs)})
    return field(default=default, metadata={"rule": Rule(**kwargs)})


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Dotted paths of keys that are not fields of their node's schema dataclass."""
    schema = OmegaConf.get_type(cfg)
    is_schema = dataclasses.is_dataclass(schema)
    known = {f.name for f in dataclasses.fields(schema)} if is_schema else None
    found = []
    for key in cfg.keys():
        if known is not None and key not in known:
            found.append(f"{prefix}{key}")
        elif isinstance(cfg[key], DictConfig):
            found += unknown_keys(cfg[key], f"{prefix}{key}.")
    return found


def check_known_keys(cfg: DictConfig) -> None:
    """Raise ValueError naming every key no schema declares (e.g. added as ``+optim.lrr=1``)."""
    if bad := unknown_keys(cfg):
        raise ValueError(f"unknown config key(s) {', '.join(bad)}: not in the schemas of "
                         f"recipes/config_schema.py, so nothing would read them (a typo?)")


def bad_values(cfg: DictConfig, prefix: str = "") -> list[str]:
    """``"key=value <rule>"`` for every value that breaks its schema field's :class:`Rule`,
    and for the rules that relate two fields."""
    schema = OmegaConf.get_type(cfg)
    fields = dataclasses.fields(schema) if dataclasses.is_dataclass(schema) else ()
    # a schema field without a rule still refuses NaN and infinity (every number is finite
    # unless its rule says allow_inf)
    rules = {f.name: f.metadata.get("rule", _FINITE) for f in fields}
    found = []
    for key in cfg.keys():
        value = cfg[key]
        if isinstance(value, DictConfig):
            found += bad_values(value, f"{prefix}{key}.")
            continue
        if isinstance(value, ListConfig):
            value = OmegaConf.to_container(value)
        if key in rules and (why := rules[key].broken_by(value)):
            found.append(f"{prefix}{key}={value} {why}")
    # rules that relate two fields run only on fields that passed their own rules: a cross-check
    # of d_model % n_head would otherwise divide by the n_head=0 its own rule refuses
    if hasattr(schema, "cross_check") and not found:
        found += [f"{prefix}{problem}" for problem in schema.cross_check(cfg)]
    return found


def check_values(cfg: DictConfig) -> None:
    """Raise ValueError naming every config value its schema's rules refuse."""
    if bad := bad_values(cfg):
        raise ValueError("config value(s) out of range: " + "; ".join(bad))


def check_config(cfg: DictConfig) -> None:
    """Every key known (:func:`check_known_keys`) and every value in range (:func:`check_values`):
    what a recipe's main calls before any work starts."""
    check_known_keys(cfg)
    check_values(cfg)
