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

Time until the call (models/timing.py), over the steps whose call arrives (neither END nor past
the end, and its gap known), with log time z = log(seconds + offset_s), per k and over all steps (no ``_k`` suffix):

- ``time_mae_log_k{k}``: mean absolute error of the predicted median's log time;
- ``time_below_q{100q}_k{k}`` and ``time_at_or_below_q{100q}_k{k}`` for each quantile level q
  (``time_below_q10``...): the share of true times strictly below, and at or below, the predicted
  q-quantile (both within float rounding). Calibrated: below <= q <= at or below. Both are q for a
  continuous time; where many gaps are exactly 0 (an atom), a quantile at 0 has none below it
  and all the zeros at it.
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


def quantile_label(level: float) -> str:
    """0.1 -> "q10", 0.975 -> "q97.5": the metric name of a quantile level."""
    return f"q{round(level * 100, 6):g}"


def time_metric_names(levels) -> list[str]:
    return ["time_mae_log"] + [f"time_{side}_{quantile_label(q)}" for q in levels for side in ("below", "at_or_below")]


def time_metrics(log_time: np.ndarray, times: np.ndarray, levels, offset_s: float, prefix: str) -> dict[str, float | None]:
    """Flat ``{prefix}/time_*`` for log-time quantiles [N, K, Q] and true seconds [N, K] (NaN where
    the call does not arrive: END, past the end, or a gap the trace does not know)."""
    levels = list(levels)
    arrives = ~np.isnan(times)
    truth = np.log(np.where(arrives, times, 0.0) + offset_s)
    log_time = np.maximum(log_time, np.log(offset_s))  # as predict_when gives them: no time below 0 s
    median = log_time[..., levels.index(0.5)]
    tolerance = 1e-6  # float32 rounding: a predicted 0 s is at a true 0 s
    sides = {"below": truth[..., None] < log_time - tolerance, "at_or_below": truth[..., None] <= log_time + tolerance}
    out: dict[str, float | None] = {}
    steps = [(f"_k{k + 1}", np.zeros_like(arrives)) for k in range(times.shape[1])] + [("", arrives)]
    for k in range(times.shape[1]):
        steps[k][1][:, k] = arrives[:, k]
    for suffix, mask in steps:
        some = mask.any()
        out[f"{prefix}/time_mae_log{suffix}"] = float(np.abs(median - truth)[mask].mean()) if some else None
        for j, q in enumerate(levels):
            for side, hit in sides.items():
                out[f"{prefix}/time_{side}_{quantile_label(q)}{suffix}"] = float(hit[..., j][mask].mean()) if some else None
    return out


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
