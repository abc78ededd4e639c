"""Per-step predictor metrics (docs/predictors.md), for each k = 1..K:

- ``top1_k{k}``: unconditional top-1 over every prefix: a step past the workflow's end counts as
  END, and the predictor's answer is the argmax of its unconditional distribution
  (agent a: s^(k) P^(k)[a]; END: the rest, 1 - s^(k) (1 - P^(k)[END])), s^(k) its survival;

over the prefixes whose workflow is still alive at step k (labels not masked), the predictor's
own distribution P^(k) (conditional on the workflow still running):

- ``top1_alive_k{k}``, ``top3_k{k}``: top-1 / top-3 accuracy over agents + END;
- ``nll_k{k}``: mean negative log-likelihood of the true class;
- ``ece_k{k}``: expected calibration error of the top-1 confidence (15 equal-width bins);
- ``end_acc_k{k}``: accuracy of the binary decision "the workflow ends at step k"
  (predicted class is END vs. true class is END).
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import accuracy_score, log_loss, top_k_accuracy_score
from torchmetrics.functional.classification import multiclass_calibration_error

METRIC_NAMES = ("top1", "top1_alive", "top3", "nll", "ece", "end_acc")


def step_metrics(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """probs [N, C] (rows sum to 1), labels [N] in 0..C-1; END is class C-1."""
    n_classes = probs.shape[1]
    classes = np.arange(n_classes)
    predicted = probs.argmax(axis=1)
    end = n_classes - 1
    return {
        "top1_alive": accuracy_score(labels, predicted),
        "top3": 1.0 if n_classes <= 3 else top_k_accuracy_score(labels, probs, k=3, labels=classes),
        "nll": log_loss(labels, probs, labels=classes),
        "ece": multiclass_calibration_error(torch.from_numpy(probs).float(), torch.from_numpy(labels),
                                            num_classes=n_classes, n_bins=15, norm="l1").item(),
        "end_acc": accuracy_score(labels == end, predicted == end),
    }


def horizon_metrics(probs: np.ndarray, labels: np.ndarray, prefix: str) -> dict[str, float | None]:
    """Flat ``{prefix}/{metric}_k{k}`` for probs [N, K, C] and labels [N, K] (negative = masked)."""
    probs = probs.astype(np.float64)
    probs /= probs.sum(axis=-1, keepdims=True)
    end = probs.shape[-1] - 1
    survival = np.cumprod(np.concatenate([np.ones_like(probs[:, :1, end]), 1 - probs[:, :-1, end]], axis=1), axis=1)
    unconditional = probs * survival[..., None]
    unconditional[..., end] = 1 - unconditional[..., :end].sum(axis=-1)
    out: dict[str, float | None] = {}
    for k in range(probs.shape[1]):
        alive = labels[:, k] >= 0
        values = step_metrics(probs[alive, k], labels[alive, k]) if alive.any() else {}
        if len(labels):
            truth = np.where(alive, labels[:, k], end)
            values["top1"] = accuracy_score(truth, unconditional[:, k].argmax(axis=1))
        for name in METRIC_NAMES:
            value = values.get(name)
            out[f"{prefix}/{name}_k{k + 1}"] = None if value is None else float(value)
    return out
