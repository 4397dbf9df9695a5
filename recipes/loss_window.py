"""The per-step records of a training loop whose losses are still on the device.

Reading a loss to the host (``.item()``) waits for the device to finish everything queued before
it, so a loop that reads it every step cannot queue the next step's work ahead. The loop keeps each
step's record with its loss as a device tensor and reads a whole window of losses in one transfer
when it logs (every ``trainer.log_every`` steps, at checkpoints and at the end). The values are the
ones ``.item()`` would have given, step by step.
"""

from __future__ import annotations

from typing import Any

import torch


class LossWindow:
    """Records (dicts with a ``"loss"`` tensor) waiting for their losses to be read."""

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: dict[str, Any], **extra: Any) -> None:
        """Keep ``record`` (its ``"loss"`` a 0-dim tensor), with ``extra`` fields appended."""
        loss = record.get("loss")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"LossWindow.add: the record's loss must be a 0-dim tensor, got "
                            f"{type(loss).__name__}")
        record.update(extra)
        self._records.append(record)

    def flush(self) -> list[dict[str, Any]]:
        """The kept records in order, each loss now a Python float, read in one transfer; the
        window is empty afterwards."""
        records, self._records = self._records, []
        if records:
            values = torch.stack([r["loss"].detach() for r in records]).tolist()
            for record, value in zip(records, values, strict=True):
                record["loss"] = value
        return records
