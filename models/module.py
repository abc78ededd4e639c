"""LightningModule around any Predictor: masked per-step cross-entropy, per-step metrics.

.. math::
    \\mathcal{L} = \\frac{1}{|\\{(i,k): y_{ik} \\ne \\varnothing\\}|}
    \\sum_{i,k:\\, y_{ik} \\ne \\varnothing} -\\log P_i^{(k)}[y_{ik}]

(steps past a workflow's end carry no label). Beside it, the time head's pinball loss on log time
(models/timing.py) over the steps whose call arrives (neither END nor past the end), weighted by
``TimeConfig.loss_weight``:

.. math::
    \mathcal{L}_{time} = \frac{1}{|\{(i,k)\}| \, Q} \sum_{i,k} \sum_q
    \rho_q\bigl(\log(T_{ik} + c) - z_{ikq}\bigr), \qquad
    \rho_q(r) = \max(q r, (q - 1) r)

It reaches only the time head's weights (the heads read detached features), so training minimises
``loss + loss_weight * time_loss`` with the next-agent weights moving exactly as under ``loss``
alone; ``{split}/loss`` (what checkpointing and early stopping watch) stays the cross-entropy,
``{split}/time_loss`` is logged beside it. Validation and test collect the probabilities and
times of the whole split and log the metrics of models.metrics.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from models.base import IGNORE_INDEX, PrefixBatch, Predictor
from models.metrics import horizon_metrics, time_metrics
from models.timing import pinball_loss


class PredictorModule(pl.LightningModule):
    def __init__(self, predictor: Predictor, optimizer: Callable | None = None, scheduler: Callable | None = None,
                 time_weight: float = 1.0):
        """`time_weight`: TimeConfig.loss_weight, the pinball loss's weight."""
        super().__init__()
        self.predictor = predictor
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.time_weight = float(time_weight)
        self._outputs: dict[str, list[tuple[Tensor, ...]]] = {"val": [], "test": []}
        self.split_metrics: dict[str, dict[str, float | None]] = {}  # latest full-precision metrics

    def forward(self, batch: PrefixBatch) -> Tensor:
        return self.predictor(batch)

    def loss(self, batch) -> tuple[Tensor, Tensor, Tensor]:
        """The cross-entropy, the logits and the labels."""
        loss, _, logits, _ = self.losses(batch)
        return loss, logits, batch[3]

    def losses(self, batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Cross-entropy, pinball loss of log time, logits [B, K, A+1], log-time quantiles [B, K, Q]."""
        path, n_calls, text, labels, times = batch
        logits, log_time = self.predictor.forward_with_time(self.predictor.example_batch(path, n_calls, text))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
        return loss, self.time_loss(log_time, times), logits, log_time

    def time_loss(self, log_time: Tensor, times: Tensor) -> Tensor:
        """Pinball loss over the steps whose call arrives (times NaN elsewhere: models.datamodule)."""
        spec = self.predictor.require_time()
        arrives = ~torch.isnan(times)
        levels = torch.tensor(spec.quantiles, dtype=log_time.dtype, device=log_time.device)
        return pinball_loss(log_time[arrives], spec.log_time(times[arrives].to(log_time.dtype)), levels)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss, time_loss, _, _ = self.losses(batch)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch[0]))
        self.log("train/time_loss", time_loss, on_step=False, on_epoch=True, batch_size=len(batch[0]))
        if not time_loss.requires_grad:  # no time head (Markov, or no gaps to learn from)
            return loss
        return loss + self.time_weight * time_loss

    def _eval_step(self, split: str, batch) -> None:
        loss, time_loss, logits, log_time = self.losses(batch)
        labels, times = batch[3], batch[4]
        self.log(f"{split}/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(labels))
        self.log(f"{split}/time_loss", time_loss, on_step=False, on_epoch=True, batch_size=len(labels))
        self._outputs[split].append((torch.softmax(logits, dim=-1).cpu(), labels.cpu(), log_time.cpu(), times.cpu()))

    def _eval_epoch_end(self, split: str) -> None:
        outputs, self._outputs[split] = self._outputs[split], []
        if self.trainer.sanity_checking or not outputs:
            return
        probs = torch.cat([o[0] for o in outputs]).double().numpy()
        labels = torch.cat([o[1] for o in outputs]).numpy()
        log_time = torch.cat([o[2] for o in outputs]).double().numpy()
        times = torch.cat([o[3] for o in outputs]).double().numpy()
        spec = self.predictor.require_time()
        metrics = horizon_metrics(probs, labels, split)
        metrics.update(time_metrics(log_time, times, spec.quantiles, spec.offset_s, split))
        self.split_metrics[split] = metrics
        self.log_dict({k: np.nan if v is None else v for k, v in metrics.items()})

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step("val", batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step("test", batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("this model config has no optimizer")
        optimizer = self.optimizer_factory(params=[p for p in self.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}
