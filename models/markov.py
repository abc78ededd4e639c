"""Order-n Markov predictor with backoff and smoothing; K steps by exact propagation.

Counts :math:`n(c, a)` of next symbol a (an agent or END) after context c (the last m <= n
agents, padded with BOS at the workflow's start) give the interpolated (Dirichlet) backoff model

.. math::
    P_0(a) = \\frac{n(a) + \\alpha}{N + \\alpha (A+1)}, \\qquad
    P_m(a \\mid c) = \\frac{n(c, a) + \\beta\\, P_{m-1}(a \\mid c_{2:})}{n(c) + \\beta}

An unseen context has :math:`n(c) = 0` and so predicts exactly like its longest seen suffix.
The states of the chain are the seen contexts; after agent a, state u moves to the longest seen
suffix of (u, a). (That suffix is the same whether u is the full history or its longest seen
suffix, so the propagation is exact for this model.) With E[u, a] = P(a | u) and
T[u, u'] = sum_a E[u, a] [next(u, a) = u'] (END mass leaves the chain), the k-step distribution
conditional on survival is

.. math::
    P^{(k)} = \\frac{e_u T^{k-1} E}{e_u T^{k-1} \\mathbf{1}}

precomputed for every state, so predict() is one gather.

Time until the next calls (models/timing.py): the training gaps of each transition a -> b, backed
off to those after a and then to all gaps (models.timing.GapPools); the k = 1 quantiles from a
state are those of the mixture over the next agent b with weights P(b | u), the k >= 2 ones sum
transition gaps along paths drawn from the chain (models.timing.markov_time_table), also one
gather at predict time.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from models.base import PrefixBatch, Predictor
from models.config import MarkovConfig, hyperparameters
from models.text import TEXT_CACHE_SIZE
from models.timing import GapPools, TimeSpec, markov_time_table

BOS = -1


def _suffix(seq: Sequence[int], m: int) -> tuple[int, ...]:
    return tuple(seq[len(seq) - m:]) if m > 0 else ()


def count_contexts(sequences: Sequence[Sequence[int]], order: int, end: int) -> Counter:
    """(context, next symbol) counts for every context length 0..order."""
    counts: Counter = Counter()
    for seq in sequences:
        history = [BOS] * order + list(seq)
        for i, target in enumerate(list(seq) + [end]):
            seen = history[:order + i]
            for m in range(order + 1):
                counts[_suffix(seen, m), target] += 1
    return counts


class MarkovPredictor(Predictor):
    family = "markov"
    batch_invariant = True  # each prefix's row is looked up in `table`

    def __init__(self, agent_names, horizon: int, contexts: list[list[int]] | None = None,
                 context_counts: Tensor | None = None, max_path: int | None = None,
                 text_cache_size: int = TEXT_CACHE_SIZE, time: dict | None = None, gaps: dict | None = None,
                 **knobs):  # order, alpha, backoff: MarkovConfig
        """`gaps`: the training transitions' gaps, {"previous", "following": agent ids, "seconds"}
        (models.timing.GapPools)."""
        super().__init__(agent_names, horizon, None, max_path, text_cache_size, time)  # no text signal
        self.config = MarkovConfig(**knobs)
        if self.config.order > self.max_path:
            raise ValueError(f"order must be in [0, max_path={self.max_path}], got {self.config.order}")
        self.order, self.alpha, self.backoff = self.config.order, float(self.config.alpha), float(self.config.backoff)
        self.contexts = [tuple(c) for c in (contexts or [[]])]
        counts = context_counts if context_counts is not None else torch.zeros(1, self.n_classes)
        if counts.shape != (len(self.contexts), self.n_classes) or () not in self.contexts:
            raise ValueError("context counts do not match the contexts and the vocabulary")
        self.context_counts = counts.float()
        self._state = {c: i for i, c in enumerate(self.contexts)}
        self._state_of_history: dict[tuple[int, ...], int] = {}
        emit = self.smoothed_probs()
        self.register_buffer("table", self.k_step_table(emit, self.transition_matrix(emit)), persistent=False)
        self.gaps = None if gaps is None else {k: torch.as_tensor(v) for k, v in gaps.items()}
        self.register_buffer("time_table", self.fit_time_table(emit), persistent=False)

    @classmethod
    def from_sequences(cls, agent_names, horizon: int, sequences: Sequence[Sequence[int]],
                       max_path: int | None = None, time: TimeSpec | None = None,
                       gaps: Sequence[Sequence[float]] | None = None, **knobs) -> "MarkovPredictor":
        """Fitted from counts of `sequences` (agent ids) and, with `time`, the `gaps` of their calls
        (seconds, one per call); `knobs`: MarkovConfig's."""
        config = MarkovConfig(**knobs)
        end = len(agent_names)
        counts = count_contexts(sequences, config.order, end)
        contexts = sorted({c for c, _ in counts} | {()}, key=lambda c: (len(c), c))
        index = {c: i for i, c in enumerate(contexts)}
        table = torch.zeros(len(contexts), end + 1)
        for (c, a), n in counts.items():
            table[index[c], a] += n
        return cls(agent_names, horizon, contexts=[list(c) for c in contexts], context_counts=table,
                   max_path=max_path, time=None if time is None else time.to_dict(),
                   gaps=None if time is None else transition_gaps(sequences, gaps), **hyperparameters(config))

    @classmethod
    def from_corpus(cls, corpus, **kwargs) -> "MarkovPredictor":
        return cls.from_sequences(corpus.agent_names, corpus.horizon, corpus.train_sequences,
                                  max_path=corpus.max_path, time=TimeSpec.from_corpus(corpus),
                                  gaps=corpus.train_gaps, **kwargs)

    def init_args(self) -> dict:
        args = {"agent_names": self.agent_names, "horizon": self.horizon, "order": self.order,
                "alpha": self.alpha, "backoff": self.backoff, "contexts": [list(c) for c in self.contexts],
                "context_counts": self.context_counts, "max_path": self.max_path, **self.time_init_args()}
        if self.gaps is not None:
            args["gaps"] = self.gaps
        return args

    # ------------------------------------------------------------------ fitting
    def smoothed_probs(self) -> Tensor:
        """E[u, a] = P_m(a | u) for every seen context u (contexts are sorted by length)."""
        counts = self.context_counts.double()
        probs = torch.zeros_like(counts)
        for i, c in enumerate(self.contexts):
            if c == ():
                probs[i] = (counts[i] + self.alpha) / (counts[i].sum() + self.alpha * self.n_classes)
            else:
                lower = probs[self._state[c[1:]]]
                probs[i] = (counts[i] + self.backoff * lower) / (counts[i].sum() + self.backoff)
        return probs

    def longest_seen_suffix(self, history: Sequence[int]) -> int:
        for m in range(min(self.order, len(history)), -1, -1):
            state = self._state.get(_suffix(history, m))
            if state is not None:
                return state
        raise AssertionError("the empty context is always a state")

    def transition_matrix(self, emit: Tensor) -> Tensor:
        n_states, n_agents = len(self.contexts), self.end_index
        trans = torch.zeros(n_states, n_states, dtype=emit.dtype)
        for u, context in enumerate(self.contexts):
            for a in range(n_agents):
                trans[u, self.longest_seen_suffix(context + (a,))] += emit[u, a]
        return trans

    def k_step_table(self, emit: Tensor, trans: Tensor) -> Tensor:
        """[S, K, A+1]: P^(k) from each state, conditional on survival to step k."""
        reach = torch.eye(len(self.contexts), dtype=emit.dtype)  # e_u T^{k-1}, all u at once
        steps = []
        for _ in range(self.horizon):
            alive = reach.sum(dim=1, keepdim=True)
            step = reach @ emit / alive.clamp(min=1e-300)
            step[alive.squeeze(1) <= 1e-300, -1] = 1.0  # a chain that surely ended predicts END
            steps.append(step)
            reach = reach @ trans
        return torch.stack(steps, dim=1).float()

    def fit_time_table(self, emit: Tensor) -> Tensor:
        """[S, K, Q] seconds from each state (models.timing.markov_time_table); empty without gaps."""
        spec = self.time_spec
        if spec is None or spec.fallback or self.gaps is None:
            return torch.zeros(0)
        n_agents = self.end_index
        pools = GapPools(self.gaps["previous"].numpy(), self.gaps["following"].numpy(),
                         self.gaps["seconds"].double().numpy(), n_agents, spec.min_samples)
        next_state = np.array([[self.longest_seen_suffix(c + (a,)) for a in range(n_agents)] for c in self.contexts],
                              dtype=np.int64).reshape(len(self.contexts), n_agents)
        previous = np.array([c[-1] if c and c[-1] != BOS else n_agents for c in self.contexts], dtype=np.int64)
        return markov_time_table(emit.numpy(), next_state, previous, pools, self.horizon, spec.quantiles, spec.paths)

    # ------------------------------------------------------------------ prediction
    def states(self, batch: PrefixBatch) -> Tensor:
        rows, n_calls = batch.path.tolist(), batch.n_calls.tolist()
        memo, order = self._state_of_history, self.order
        states = []
        for row, n in zip(rows, n_calls):
            history = row[len(row) - min(n, len(row)):]
            if n < order:
                history = [BOS] * (order - n) + history
            key = _suffix(history, order)
            state = memo.get(key)
            if state is None:
                state = memo[key] = self.longest_seen_suffix(key)
            states.append(state)
        return torch.tensor(states, dtype=torch.long, device=self.table.device)

    def probs(self, batch: PrefixBatch) -> Tensor:
        return self.table[self.states(batch)]

    def forward(self, batch: PrefixBatch) -> Tensor:
        return self.probs(batch).clamp(min=1e-12).log()

    def forward_with_time(self, batch: PrefixBatch) -> tuple[Tensor, Tensor]:
        if not len(self.time_table):  # no gaps in the training traces: the per-agent table
            return self(batch), self.agent_log_time(batch)
        states = self.states(batch)
        return self.table[states].clamp(min=1e-12).log(), self.time_spec.log_time(self.time_table[states])


def transition_gaps(sequences: Sequence[Sequence[int]], gaps: Sequence[Sequence[float]]) -> dict[str, Tensor]:
    """Every training transition's agents and gap: call j's gap after call j-1's agent."""
    previous, following, seconds = [], [], []
    for seq, seq_gaps in zip(sequences, gaps):
        if len(seq) != len(seq_gaps):
            raise ValueError(f"a workflow has {len(seq)} calls but {len(seq_gaps)} gaps")
        previous += list(seq[:-1])
        following += list(seq[1:])
        seconds += list(seq_gaps[1:])
    return {"previous": torch.tensor(previous, dtype=torch.long), "following": torch.tensor(following, dtype=torch.long),
            "seconds": torch.tensor(seconds, dtype=torch.float64)}
