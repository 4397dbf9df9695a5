"""Click-through-rate metrics: ROC AUC and log loss of predicted logits against 0/1 labels.

AUC is the Mann-Whitney statistic: the probability that a random positive scores above a random
negative, ties counting half. It is computed from average ranks (one sort), exact and O(n log n).
Written here rather than pulling in scikit-learn for one formula; the tests check it against the
pairwise definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` (higher means positive) for 0/1 ``labels``."""
    scores, labels = scores.detach().flatten().double(), labels.detach().flatten().double()
    if scores.shape != labels.shape:
        raise ValueError(f"{scores.numel()} scores for {labels.numel()} labels")
    positives = labels.sum()
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs at least one positive and one negative label")
    order = scores.argsort()
    _, group, counts = torch.unique_consecutive(scores[order], return_inverse=True,
                                                return_counts=True)
    last = counts.cumsum(0).double()  # 1-based rank of each tie group's last member
    ranks = (last - (counts - 1) / 2)[group]  # average rank within a tie group
    rank_sum = (ranks * labels[order]).sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy (nats) of ``sigmoid(logits)`` against 0/1 ``labels``."""
    return float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))
