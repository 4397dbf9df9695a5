"""A generator of Criteo-format click logs with a planted signal, so the recipe runs without a
download and what it should learn is known.

Each row's click probability is ``sigmoid(logit)`` of a hidden model, shaped like real click logs:

* 26 categorical fields with 4 to ~4000 distinct values each, drawn from a log-uniform (Zipf-like)
  law, so a few values are frequent and most are rare; half the fields carry a weight per value
  (the wide part's job), the others are noise;
* one pairwise interaction between two fields' latent factors (what the deep part adds);
* 13 count features, log-normal, six of them weighted after ``log1p``;
* values go missing at random (8 % of counts, 3 % of categories); a missing one adds nothing;
* a bias, solved for so that a quarter of the rows are clicks (Criteo's rate is ~25 %).

Alongside the TSV the generator saves each row's true logit (``<file>.logits.pt``), so the best
AUC any model can reach on the eval split is known (the oracle AUC the recipe prints). The file is
a pure function of (seed, rows) and is written once into the cache directory, atomically, so
concurrent ranks may both call :func:`synthetic_criteo`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from recipes.criteo import NUM_DENSE, NUM_SPARSE

SYNTH_VERSION = 1  # bump when the hidden model changes, so stale cache files are not reused
CARDINALITY = [round(10 ** (0.6 + 3.0 * f / (NUM_SPARSE - 1))) for f in range(NUM_SPARSE)]
INTERACTING = (1, 3)  # the two fields whose latent factors multiply
DENSE_WEIGHTS = [0.5, -0.4, 0.3, -0.3, 0.25, 0.2] + [0.0] * (NUM_DENSE - 6)
CLICK_RATE, FIELD_SCALE, INTERACTION_SCALE = 0.25, 0.7, 0.9
MISSING_DENSE, MISSING_SPARSE = 0.08, 0.03


def _hidden_model(gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per field: a weight per value (zero for the noise fields) and a latent factor per value."""
    weights, latent = [], []
    for f, card in enumerate(CARDINALITY):
        scale = FIELD_SCALE if f % 2 == 0 else 0.0
        weights.append(torch.randn(card, generator=gen, dtype=torch.float64) * scale)
        latent.append(torch.randn(card, generator=gen, dtype=torch.float64))
    return weights, latent


def _bias_for(logit: torch.Tensor, rate: float) -> float:
    """The bias b with mean(sigmoid(logit + b)) = rate (bisection: the mean rises with b)."""
    low, high = -30.0, 30.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if torch.sigmoid(logit + mid).mean() < rate else (low, mid)
    return (low + high) / 2


def generate(rows: int, seed: int) -> tuple[list[str], torch.Tensor]:
    """``rows`` TSV lines (no newline) and their true logits."""
    gen = torch.Generator().manual_seed(seed)
    weights, latent = _hidden_model(gen)
    u = torch.rand(rows, NUM_SPARSE, generator=gen, dtype=torch.float64)
    card = torch.tensor(CARDINALITY, dtype=torch.float64)
    values = (card.pow(u).floor().long() - 1).clamp_(min=0)  # log-uniform over 0 .. card - 1
    present = torch.rand(rows, NUM_SPARSE, generator=gen) >= MISSING_SPARSE
    counts = torch.exp(torch.randn(rows, NUM_DENSE, generator=gen, dtype=torch.float64) * 1.2
                       + 1.5).floor().long()
    counted = torch.rand(rows, NUM_DENSE, generator=gen) >= MISSING_DENSE
    logit = torch.zeros(rows, dtype=torch.float64)
    for f in range(NUM_SPARSE):
        logit += weights[f][values[:, f]] * present[:, f]
    a, b = INTERACTING
    logit += (INTERACTION_SCALE * latent[a][values[:, a]] * latent[b][values[:, b]]
              * present[:, a] * present[:, b])
    z = torch.log1p(counts.double())
    z = (z - z.mean(0)) / z.std(0)
    logit += (z * torch.tensor(DENSE_WEIGHTS, dtype=torch.float64) * counted).sum(1)
    logit += _bias_for(logit, CLICK_RATE)
    labels = (torch.rand(rows, generator=gen, dtype=torch.float64) < torch.sigmoid(logit)).long()
    # Criteo's categorical values are 8 hex digits; these encode (field, value) the same way.
    hashed = (values * 2654435761 + torch.arange(1, NUM_SPARSE + 1) * 40503) % 2**32
    lines = []
    for r in range(rows):
        ints = [str(c) if ok else "" for c, ok in zip(counts[r].tolist(), counted[r].tolist(),
                                                       strict=True)]
        cats = [f"{h:08x}" if ok else "" for h, ok in zip(hashed[r].tolist(),
                                                           present[r].tolist(), strict=True)]
        lines.append("\t".join([str(int(labels[r])), *ints, *cats]))
    return lines, logit.float()


def synthetic_criteo(cache_dir: str | os.PathLike, seed: int, rows: int) -> Path:
    """Path of the generated file for (seed, rows), writing it (and its logits) on first use."""
    path = Path(cache_dir) / f"criteo_synth_v{SYNTH_VERSION}_seed{seed}_{rows}.txt"
    if path.is_file() and logits_path(path).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lines, logits = generate(rows, seed)
    suffix = f".tmp{os.getpid()}"
    tmp_logits = logits_path(path).with_name(logits_path(path).name + suffix)
    torch.save(logits, tmp_logits)
    os.replace(tmp_logits, logits_path(path))
    tmp = path.with_name(path.name + suffix)
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # the TSV last: its presence means both files are complete
    return path


def logits_path(path: Path) -> Path:
    """Where the true logits of a generated file live (absent for real Criteo files)."""
    return path.with_name(path.name + ".logits.pt")
