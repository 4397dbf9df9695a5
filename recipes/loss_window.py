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
        """The kept records in order, each loss (and any other 0-dim tensor field: the gradient
        norm) now a Python float, read in one transfer per device; the window is empty
        afterwards."""
        records, self._records = self._records, []
        fields: dict[torch.device, list[tuple[dict[str, Any], str]]] = {}
        for record in records:
            for key, value in record.items():
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    fields.setdefault(value.device, []).append((record, key))
        for places in fields.values():
            values = torch.stack([record[key].detach().double() for record, key in places])
            for (record, key), value in zip(places, values.tolist(), strict=True):
                record[key] = value
        return records
