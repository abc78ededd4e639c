"""The one predictor interface the simulator and the SGLang plugin call (docs/predictors.md).

For a live workflow after its t-th call, a predictor returns K distributions over the agents
plus END, in one forward pass:

.. math::
    P^{(k)} \\in \\Delta^{A}, \\quad k = 1..K, \\qquad
    s^{(k)} = \\prod_{j<k} \\bigl(1 - P^{(j)}[\\mathrm{END}]\\bigr)

:math:`P^{(k)}` is conditional on the workflow still being alive at step k (so its END entry is
a hazard) and :math:`s^{(k)}` (:func:`survival`) is the probability that it is. The unconditional
chance that the k-th next call goes to agent a is :math:`s^{(k)} P^{(k)}[a]`.

Vocabulary: ``agent_names[0]`` is ``"<unk>"`` (agents the checkpoint never saw map there),
``agent_names[1:]`` are the training agents in sorted order, and END is index
``len(agent_names)``.

Beside them, :meth:`Predictor.predict_when` also gives, for each of the K steps, quantiles of the
time until that call arrives, in seconds from the end of the latest call (models/timing.py says
precisely what that time counts and what the serving side adds to it):

.. math::
    \tau^{(k)}_q, \quad q \in \texttt{time\_quantiles}, \quad k = 1..K
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from models.text import TEXT_CACHE_SIZE, TextFeatures, TextSpec
from models.timing import TimeSpec

UNK = "<unk>"
UNK_ID = 0
IGNORE_INDEX = -100  # label of a step past the workflow's end (masked out of loss and metrics)


@dataclass
class WorkflowPrefix:
    """What the serving side knows about one live workflow after its latest call."""

    agents: list[str]  # agents this live workflow has called so far, in order (>= 1)
    task: str = ""  # the workflow's task text
    # the serving model's hidden state at the latest request's last prefill token, if known (floats: a
    # list or an array): of the model's hidden size, or already projected to the predictor's input
    # size (Predictor.project_hidden)
    hidden: Sequence[float] | None = None


@dataclass
class PrefixBatch:
    """A batch of prefixes as tensors; the same layout in training and in serving.

    ``path`` holds the last ``L`` agent ids of each prefix, right-aligned (the current agent is
    in the last column) and left-padded with ``<unk>``; ``mask`` marks the real entries and
    ``n_calls`` counts all calls so far (the path may be truncated to ``max_path``).
    """

    path: Tensor  # [B, L] long
    n_calls: Tensor  # [B] long, >= 1
    text: Tensor  # [B, D] float (D = 0 when the predictor uses no text signal)
    # identity vectors [M, D_id] of agents outside the vocabulary that the path names with ids
    # n_classes + j (predictors that embed agents by name and system prompt); None: such agents
    # are <unk> in the path
    unseen: Tensor | None = None

    @property
    def mask(self) -> Tensor:
        width = self.path.shape[1]
        real = self.n_calls.clamp(max=width)
        return torch.arange(width, device=self.path.device) >= (width - real)[:, None]

    @property
    def positions(self) -> Tensor:
        """Absolute step index of every path column (0 = the workflow's first call), >= 0."""
        width = self.path.shape[1]
        offset = torch.arange(width - 1, -1, -1, device=self.path.device)
        return (self.n_calls[:, None] - 1 - offset).clamp(min=0)

    def to(self, device) -> "PrefixBatch":
        return PrefixBatch(self.path.to(device), self.n_calls.to(device), self.text.to(device),
                           None if self.unseen is None else self.unseen.to(device))


def survival(probs: Tensor) -> Tensor:
    """s^(k) = prod_{j<k} (1 - P^(j)[END]) for probs [..., K, A+1]; returns [..., K], s^(1) = 1."""
    alive = 1.0 - probs[..., -1]
    ones = torch.ones_like(alive[..., :1])
    return torch.cat([ones, alive[..., :-1]], dim=-1).cumprod(dim=-1)


def vocabulary(agents) -> list[str]:
    """The agent vocabulary of a set of agents: "<unk>" first, then the agents sorted."""
    return [UNK] + sorted(set(agents) - {UNK})


def check_agent_names(agent_names: Sequence[str]) -> list[str]:
    names = list(agent_names)
    if not names or names[0] != UNK:
        raise ValueError(f"agent vocabulary must start with {UNK!r}, got {names[:3]}")
    if len(set(names)) != len(names):
        raise ValueError("agent vocabulary has duplicate names")
    return names


def default_max_path() -> int:
    """The path length of a predictor built outside training: the datamodule's knob."""
    from models.config import DataModuleConfig

    return DataModuleConfig.max_path


class Predictor(nn.Module, ABC):
    """Base of all four families: vocabulary, prefix encoding, text features, predict().

    Subclasses implement :meth:`forward` (a :class:`PrefixBatch` to logits [B, K, A+1]) and
    :meth:`init_args` (the plain constructor arguments a checkpoint stores); those that predict
    time better than the per-agent empirical table (models.timing.agent_table) override
    :meth:`forward_with_time`.
    """

    family: ClassVar[str]
    # True when a prefix's probabilities are the same floats whatever else shares its batch (a
    # table lookup): the simulator may then compute them all before a replay
    # (serving_integration/cache/predictions.py PrefixTable). Float32 networks are not: their
    # kernels' summation order depends on the batch (padding width, matrix shapes).
    batch_invariant: ClassVar[bool] = False

    def __init__(self, agent_names: Sequence[str], horizon: int, text: dict | None = None,
                 max_path: int | None = None, text_cache_size: int = TEXT_CACHE_SIZE, time: dict | None = None):
        """`time`: a models.timing.TimeSpec as a dict (None: a checkpoint from before time prediction;
        predict_when then refuses)."""
        super().__init__()
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.agent_names = check_agent_names(agent_names)
        self.horizon = int(horizon)
        self.max_path = int(max_path if max_path is not None else default_max_path())
        self.text_spec = TextSpec.from_dict(text)
        self.text_features = TextFeatures(self.text_spec, text_cache_size)
        if self.text_features.projection is not None:  # the same tensor: loading a checkpoint fills it in place
            self.register_buffer("hidden_projection", self.text_features.projection)
        self._agent_index = {name: i for i, name in enumerate(self.agent_names)}
        self.time_spec = TimeSpec.from_dict(time)
        if self.time_spec is not None and tuple(self.time_spec.table.shape[:2]) != (self.n_classes, self.horizon):
            raise ValueError(f"time table has shape {tuple(self.time_spec.table.shape)}, the vocabulary and horizon "
                             f"need ({self.n_classes}, {self.horizon}, Q)")

    # ------------------------------------------------------------------ vocabulary
    @property
    def n_classes(self) -> int:
        """Agents (with <unk>) plus END."""
        return len(self.agent_names) + 1

    @property
    def end_index(self) -> int:
        return len(self.agent_names)

    def agent_id(self, name: str) -> int:
        return self._agent_index.get(name, UNK_ID)

    # ------------------------------------------------------------------ interface
    @abstractmethod
    def forward(self, batch: PrefixBatch) -> Tensor:
        """Logits [B, K, A+1]; softmax over the last axis gives P^(1..K)."""

    def forward_with_time(self, batch: PrefixBatch) -> tuple[Tensor, Tensor]:
        """Logits [B, K, A+1] (exactly :meth:`forward`'s) and log-time quantiles [B, K, Q]
        (models.timing: z = log(seconds + offset_s)); here the per-agent empirical table."""
        return self(batch), self.agent_log_time(batch)

    def agent_log_time(self, batch: PrefixBatch) -> Tensor:
        return self.require_time().agent_log_time(batch.path[:, -1])

    def require_time(self) -> TimeSpec:
        if self.time_spec is None:
            raise ValueError(f"this {self.family} predictor was saved before predictors gave times; retrain it "
                             "(python train.py ...) for predict_when")
        return self.time_spec

    @property
    def time_quantiles(self) -> list[float]:
        """The levels q of predict_when's last axis (TimeConfig.quantiles of the training run)."""
        return list(self.require_time().quantiles)

    @property
    def time_fallback(self) -> bool:
        """True when the training traces had no gaps: the times are the per-agent empirical table."""
        return self.require_time().fallback

    def time_init_args(self) -> dict:
        return {} if self.time_spec is None else {"time": self.time_spec.to_dict()}

    @abstractmethod
    def init_args(self) -> dict:
        """Constructor keyword arguments, as plain values and tensors (stored in checkpoints)."""

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def encode_prefixes(self, prefixes: Sequence[WorkflowPrefix]) -> PrefixBatch:
        if not prefixes:
            raise ValueError("predict() needs at least one workflow prefix")
        index, width_cap = self._agent_index, self.max_path
        windows = [p.agents[-width_cap:] for p in prefixes]
        lengths = np.fromiter((len(w) for w in windows), dtype=np.int64, count=len(windows))
        if lengths.min() == 0:
            raise ValueError("a WorkflowPrefix needs at least one agent (the call that just finished)")
        # right-aligned [B, L] ids, filled with one flat scatter instead of a padded list per row
        flat = np.fromiter((index.get(a, -1) for w in windows for a in w), dtype=np.int64, count=lengths.sum())
        unseen = None
        if (flat < 0).any():
            unseen = self.encode_unseen(flat, [a for w in windows for a in w])
        width = int(lengths.max())
        rows = np.repeat(np.arange(len(windows)), lengths)
        starts = np.cumsum(lengths) - lengths
        cols = np.arange(len(flat)) - starts[rows] + (width - lengths)[rows]
        path = np.zeros((len(windows), width), dtype=np.int64)  # UNK_ID padding
        path[rows, cols] = flat
        n_calls = np.fromiter((len(p.agents) for p in prefixes), dtype=np.int64, count=len(prefixes))
        device = self.device
        return PrefixBatch(torch.from_numpy(path).to(device), torch.from_numpy(n_calls).to(device),
                           self.text_features(prefixes).to(device), None if unseen is None else unseen.to(device))

    def example_batch(self, path: Tensor, n_calls: Tensor, text: Tensor) -> PrefixBatch:
        """A batch of the data module's examples, whose paths name val/test agents outside the
        vocabulary with ids >= n_classes (models.datamodule): <unk> here."""
        return PrefixBatch(path.masked_fill(path >= self.n_classes, UNK_ID), n_calls, text)

    def encode_unseen(self, ids: np.ndarray, names: Sequence[str]) -> Tensor | None:
        """Agents outside the vocabulary (ids < 0 in the flat path): here they become <unk>;
        predictors that embed agents by identity give them ids past the vocabulary instead and
        return their identity vectors (models.graphsage)."""
        ids[ids < 0] = UNK_ID
        return None

    @torch.inference_mode()
    def predict(self, prefixes: Sequence[WorkflowPrefix]) -> Tensor:
        """P^(1..K) for each prefix: [B, K, len(agent_names) + 1], rows sum to 1."""
        was_training = self.training
        if was_training:
            self.eval()
        try:
            return torch.softmax(self(self.encode_prefixes(prefixes)), dim=-1)
        finally:
            if was_training:
                self.train()

    @torch.inference_mode()
    def predict_when(self, prefixes: Sequence[WorkflowPrefix]) -> tuple[Tensor, Tensor]:
        """One forward pass: P^(1..K) as :meth:`predict` gives them, [B, K, len(agent_names) + 1], and
        the quantiles of the time until each of the K calls, [B, K, len(time_quantiles)] seconds from
        the end of the latest call (conditional on the call happening; models/timing.py)."""
        spec = self.require_time()
        was_training = self.training
        if was_training:
            self.eval()
        try:
            logits, log_time = self.forward_with_time(self.encode_prefixes(prefixes))
            return torch.softmax(logits, dim=-1), spec.seconds(log_time)
        finally:
            if was_training:
                self.train()

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @property
    def uses_hidden(self) -> bool:
        """Whether the text signal is the serving model's hidden state."""
        return self.text_spec.source == "hidden"

    def project_hidden(self, rows: Tensor) -> Tensor:
        """Hidden states [B, hidden size] -> the predictor's text input [B, D] (the checkpoint's fixed
        projection, if any): what the serving plugin stores per live workflow."""
        return self.text_features.project(rows)

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
