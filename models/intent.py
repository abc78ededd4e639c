"""Intent-memory residual over a Markov prior (IntentKV's idea applied to agent prediction).

Each request j of the workflow is encoded as the unit vector
:math:`e_j = \\mathrm{norm}(E[a_j] + W_t x_{txt})` (the agent it went to, plus the workflow's
text signal: the interface carries one text signal per prefix, so every request shares it).
The session intent memory is the decayed sum

.. math::
    M_t = e^{-\\lambda} M_{t-1} + e_t = \\sum_{j \\le t} e^{-\\lambda (t-j)} e_j,
    \\qquad \\hat M_t = M_t / \\lVert M_t \\rVert

computed for the whole path at once (weights instead of a recurrence). A two-layer GELU head
reads :math:`[\\hat M_t; W_t x_{txt}]` and adds to the prior's log-probabilities:

.. math::
    \\mathrm{logits} = \\log P_{\\mathrm{markov}} + \\alpha \\, \\mathrm{MLP}([\\hat M_t; W_t x_{txt}])

The head's last layer starts at zero, so before training the output equals the prior exactly.

Time until the next calls (models/timing.py): the same way, a time head reads the detached
features and adds to the Markov prior's log-time quantiles (zero at the start; built last, off the
global random stream: models.timing.fresh_rng_head), so its pinball loss trains that head only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.base import PrefixBatch, Predictor
from models.config import IntentResidualConfig, hyperparameters
from models.markov import MarkovPredictor
from models.text import TEXT_CACHE_SIZE
from models.timing import fresh_rng_head, time_head, timed


class IntentResidualPredictor(Predictor):
    family = "intent_residual"

    def __init__(self, agent_names, horizon: int, prior: dict, text: dict | None = None,
                 max_path: int | None = None, text_cache_size: int = TEXT_CACHE_SIZE, **knobs):
        """`prior`: the fitted Markov prior's init_args (its time spec and gaps are this predictor's
        too); `knobs`: IntentResidualConfig's (but prior)."""
        super().__init__(agent_names, horizon, text, max_path, text_cache_size, prior.get("time"))
        self.prior = MarkovPredictor(**prior)
        if self.prior.agent_names != self.agent_names or self.prior.horizon != self.horizon:
            raise ValueError("the Markov prior's vocabulary or horizon differs from the residual's")
        self.config = IntentResidualConfig(prior=self.prior.config, **knobs)
        self.hparams = {k: v for k, v in hyperparameters(self.config).items() if k != "prior"}
        dim, hidden, use_text = self.config.dim, self.config.hidden, self.config.use_text
        self.agent_embedding = nn.Embedding(len(self.agent_names), dim)
        self.text_proj = nn.Linear(self.text_spec.dim, dim) if use_text and self.text_spec.dim else None
        self.residual = nn.Sequential(nn.Linear(2 * dim, hidden), nn.GELU(),
                                      nn.Linear(hidden, horizon * self.n_classes))
        nn.init.zeros_(self.residual[-1].weight)
        nn.init.zeros_(self.residual[-1].bias)
        self.time_head = fresh_rng_head(lambda: time_head(2 * dim, self.time_spec, horizon))

    @classmethod
    def from_corpus(cls, corpus, **knobs) -> "IntentResidualPredictor":
        config = IntentResidualConfig(**knobs)
        markov = MarkovPredictor.from_corpus(corpus, **hyperparameters(config.prior))
        own = {k: v for k, v in hyperparameters(config).items() if k != "prior"}
        return cls(corpus.agent_names, corpus.horizon, prior=markov.init_args(), text=corpus.text.to_dict(),
                   max_path=corpus.max_path, **own)

    def init_args(self) -> dict:
        return {"agent_names": self.agent_names, "horizon": self.horizon, "prior": self.prior.init_args(),
                "text": self.text_spec.to_dict(), "max_path": self.max_path, **self.hparams}

    def text_vector(self, batch: PrefixBatch) -> Tensor:
        if self.text_proj is None:
            return batch.path.new_zeros(batch.path.shape[0], self.agent_embedding.embedding_dim, dtype=torch.float)
        return self.text_proj(batch.text)

    def intent_memory(self, batch: PrefixBatch, text: Tensor) -> Tensor:
        """Unit-normalised M_t [B, d] over the (possibly truncated) path."""
        requests = F.normalize(self.agent_embedding(batch.path) + text[:, None, :], dim=-1)
        age = torch.arange(batch.path.shape[1] - 1, -1, -1, device=text.device, dtype=text.dtype)
        weights = torch.exp(-self.hparams["decay"] * age) * batch.mask
        return F.normalize((weights[..., None] * requests).sum(dim=1), dim=-1)

    def features(self, batch: PrefixBatch) -> Tensor:
        text = self.text_vector(batch)
        return torch.cat([self.intent_memory(batch, text), text], dim=-1)

    def forward(self, batch: PrefixBatch) -> Tensor:
        residual = self.residual(self.features(batch)).view(-1, self.horizon, self.n_classes)
        return self.prior(batch) + self.hparams["alpha"] * residual

    def forward_with_time(self, batch: PrefixBatch) -> tuple[Tensor, Tensor]:
        features = self.features(batch)
        prior_logits, prior_time = self.prior.forward_with_time(batch)
        logits = prior_logits + self.hparams["alpha"] * self.residual(features).view(-1, self.horizon, self.n_classes)
        if self.time_head is None:
            return logits, prior_time
        return logits, timed(self.time_head, features, prior_time)
