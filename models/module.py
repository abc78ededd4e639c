"""LightningModule around any Predictor: masked per-step cross-entropy, per-step metrics.

.. math::
    \\mathcal{L} = \\frac{1}{|\\{(i,k): y_{ik} \\ne \\varnothing\\}|}
    \\sum_{i,k:\\, y_{ik} \\ne \\varnothing} -\\log P_i^{(k)}[y_{ik}]

(steps past a workflow's end carry no label). Validation and test collect the probabilities of
the whole split and log ``{split}/loss`` plus the metrics of models.metrics.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from models.base import IGNORE_INDEX, PrefixBatch, Predictor
from models.metrics import horizon_metrics


class PredictorModule(pl.LightningModule):
    def __init__(self, predictor: Predictor, optimizer: Callable | None = None, scheduler: Callable | None = None):
        super().__init__()
        self.predictor = predictor
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self._outputs: dict[str, list[tuple[Tensor, Tensor]]] = {"val": [], "test": []}
        self.split_metrics: dict[str, dict[str, float | None]] = {}  # latest full-precision metrics

    def forward(self, batch: PrefixBatch) -> Tensor:
        return self.predictor(batch)

    def loss(self, batch) -> tuple[Tensor, Tensor, Tensor]:
        path, n_calls, text, labels = batch
        logits = self.predictor(self.predictor.example_batch(path, n_calls, text))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
        return loss, logits, labels

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss, _, _ = self.loss(batch)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch[0]))
        return loss

    def _eval_step(self, split: str, batch) -> None:
        loss, logits, labels = self.loss(batch)
        self.log(f"{split}/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(labels))
        self._outputs[split].append((torch.softmax(logits, dim=-1).cpu(), labels.cpu()))

    def _eval_epoch_end(self, split: str) -> None:
        outputs, self._outputs[split] = self._outputs[split], []
        if self.trainer.sanity_checking or not outputs:
            return
        probs = torch.cat([p for p, _ in outputs]).double().numpy()
        labels = torch.cat([y for _, y in outputs]).numpy()
        metrics = self.split_metrics[split] = horizon_metrics(probs, labels, split)
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
