"""Where the simulator's predictions come from: a trained predictor (train.py checkpoint), the
true future (the perfect predictor, a bound), or KVFlow's static agent step graph; optionally
mixed with noise. Every source returns what a `models.Predictor` returns: [B, K, A+1]
probabilities over `agent_names` plus END (last), for a batch of live workflows."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Protocol, Sequence

import torch

from models.base import WorkflowPrefix, vocabulary


class LiveWorkflow(Protocol):
    """What a prediction source may read of a live workflow in the simulator."""

    agents: list[str]  # agents called so far, in order
    task: str
    hidden: list[float] | None
    future_agents: list[str]  # the real remaining calls (only the perfect predictor reads these)


class PredictionSource(Protocol):
    agent_names: list[str]
    horizon: int

    def predict(self, workflows: Sequence[LiveWorkflow]) -> torch.Tensor: ...


class ModelSource:
    """A trained predictor (train.py checkpoint)."""

    def __init__(self, predictor):
        self.predictor = predictor
        self.agent_names, self.horizon = predictor.agent_names, predictor.horizon

    def predict(self, workflows):
        return self.predictor.predict([WorkflowPrefix(w.agents, w.task, w.hidden) for w in workflows])


def _one_hot_paths(paths: Sequence[Sequence[str]], agent_names: list[str], horizon: int) -> torch.Tensor:
    """[B, K, A+1]: step k is the path's k-th agent, or END once the path runs out."""
    index = {a: i for i, a in enumerate(agent_names)}
    end = len(agent_names)
    out = torch.zeros(len(paths), horizon, end + 1)
    for b, path in enumerate(paths):
        for k in range(horizon):
            out[b, k, index.get(path[k], 0) if k < len(path) else end] = 1.0
    return out


class PerfectSource:
    """The true next K agents of each workflow: pbkv with a perfect predictor (an upper bound)."""

    def __init__(self, agent_names: list[str], horizon: int):
        self.agent_names, self.horizon = agent_names, horizon

    def predict(self, workflows):
        return _one_hot_paths([w.future_agents[: self.horizon] for w in workflows], self.agent_names, self.horizon)


class StaticGraphSource:
    """KVFlow's view: one static agent step graph, each agent followed by its most frequent
    successor in the training traces (ties: alphabetical; END if it most often ends the
    workflow); every workflow is assumed to walk that graph."""

    def __init__(self, train_workflows: Sequence[Sequence[str]], horizon: int):
        successors: dict[str, Counter] = defaultdict(Counter)
        for agents in train_workflows:
            for a, b in zip(agents, list(agents[1:]) + [None]):
                successors[a][b] += 1
        self.next_of = {a: min(c, key=lambda b: (-c[b], b is None, b or "")) for a, c in successors.items()}
        self.agent_names = vocabulary(a for agents in train_workflows for a in agents)
        self.horizon = horizon

    def path_from(self, agent: str) -> list[str]:
        path = []
        while len(path) < self.horizon:
            agent = self.next_of.get(agent)
            if agent is None:
                break
            path.append(agent)
        return path

    def predict(self, workflows):
        return _one_hot_paths([self.path_from(w.agents[-1]) for w in workflows], self.agent_names, self.horizon)


class NoisySource:
    """Prediction error of a controlled size eps, for robustness sweeps (seeded).

    uniform:     P' = (1 - eps) P + eps R, R drawn uniformly from the simplex: random error,
                 which is benign on average.
    adversarial: P' = (1 - eps) P + eps Q, Q spread evenly over the agents that are NOT the true
                 k-th next call (END counts as a call), preferring agents the workflow already
                 ran (their cache is what the misplaced mass then protects): error aimed at the
                 policy. It reads the true future, as `PerfectSource` does (simulator only)."""

    KINDS = ("uniform", "adversarial")

    def __init__(self, inner: PredictionSource, eps: float, seed: int, kind: str = "uniform"):
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"predictor.noise must be in [0, 1]; got {eps}")
        if kind not in self.KINDS:
            raise ValueError(f"predictor.noise_kind must be one of {', '.join(self.KINDS)}; got '{kind}'")
        self.inner, self.eps, self.kind = inner, eps, kind
        self.agent_names, self.horizon = inner.agent_names, inner.horizon
        self.index = {a: i for i, a in enumerate(self.agent_names)}
        self.generator = torch.Generator().manual_seed(seed)

    def predict(self, workflows):
        probs = self.inner.predict(workflows)
        if self.eps == 0:
            return probs
        if self.kind == "adversarial":
            noise = self.wrong_mass(workflows, probs.shape)
        else:  # normalised Exp(1) draws are uniform on the simplex
            noise = torch.empty(probs.shape, dtype=torch.float64).exponential_(generator=self.generator)
            noise = noise / noise.sum(dim=-1, keepdim=True)
        return (1 - self.eps) * probs + self.eps * noise.to(probs.dtype)

    def wrong_mass(self, workflows, shape) -> torch.Tensor:
        """[B, K, A+1]: at each step, mass spread over the agents that will not be called then."""
        end = shape[-1] - 1
        out = torch.zeros(shape, dtype=torch.float64)
        for b, w in enumerate(workflows):
            ran = sorted({self.index[a] for a in w.agents if a in self.index})
            for k in range(shape[1]):
                truth = self.index.get(w.future_agents[k], -1) if k < len(w.future_agents) else end
                wrong = [i for i in ran if i != truth] or [i for i in range(end) if i != truth]
                out[b, k, wrong] = 1.0 / len(wrong)
        return out
