"""Refuse a resume whose checkpoint was written by another optimizer, naming both.

An SGD checkpoint keeps ``momentum_buffer`` per parameter, an AdamW one ``exp_avg``,
``exp_avg_sq`` and ``step``. Loading one into the other used to end in DCP's raw "Missing key in
checkpoint state_dict: optim.state.<name>.exp_avg". :func:`check_optimizer_fits` compares the
optimizer class the checkpoint recorded at save time (older checkpoints: the per-parameter state
and hyperparameter names its DCP metadata holds) with the optimizer about to load it, before
anything is read, and names both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundation import trusted_checkpoint
from recipes.checkpoint_integrity import CheckpointError

_STATE, _GROUPS = "optim.state.", "optim.param_groups."


def _last_names(keys: Any, prefix: str) -> set[str]:
    """The last name of each DCP key under ``prefix`` (``optim.state.<parameter>.<field>``: the
    parameter name may hold dots; list items such as ``betas.0`` count as ``betas``)."""
    names = set()
    for key in keys:
        if key.startswith(prefix):
            parts = key[len(prefix):].split(".")
            while parts and parts[-1].isdigit():
                parts.pop()
            if len(parts) > 1:
                names.add(parts[-1])
    return names


def _fields(keys: Any) -> tuple[set[str], set[str]]:
    keys = list(keys)
    return _last_names(keys, _STATE), _last_names(keys, _GROUPS)


def check_optimizer_fits(path: Path, optim_sd: dict[str, Any], optimizer: str,
                         saved_by: str | None) -> None:
    """Raise CheckpointError if the checkpoint at ``path`` was written by another optimizer than
    this run's ``optimizer`` class: by the class it recorded (``saved_by``), else by its
    per-parameter state and hyperparameter names. ``optim_sd`` is the flattened state dict about
    to be loaded (a nested, group-indexed one is left to DCP)."""
    if isinstance(optim_sd.get("state"), dict):
        return
    if saved_by is not None and saved_by == optimizer:
        return
    stored = trusted_checkpoint.read_metadata(path).state_dict_metadata
    (their_state, their_hyper), (our_state, our_hyper) = (
        _fields(stored), _fields(f"optim.{k}" for k in optim_sd))
    if saved_by is None and our_state <= their_state and our_hyper <= their_hyper:
        return  # an older checkpoint that holds everything this optimizer needs
    if saved_by is None and not (their_state or their_hyper):
        return  # no optimizer state in it to compare
    state_words = ", ".join(sorted(their_state)) or "none yet"
    ours = ", ".join(sorted(our_state)) or "none yet"
    raise CheckpointError(
        f"{path} was written by {saved_by or 'another optimizer'} (optimizer state "
        f"{state_words}), but this run's optimizer is {optimizer} (state {ours}; "
        f"hyperparameters {', '.join(sorted(our_hyper - their_hyper)) or 'the same'} not in the "
        f"checkpoint); resume with the optimizer the checkpoint was written with (optim=...), "
        f"or start a fresh run")
