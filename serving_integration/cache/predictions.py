"""Where the simulator's predictions come from: a trained predictor (train.py checkpoint), the
true future (the perfect predictor, a bound), or KVFlow's agent step graph; optionally
mixed with noise. Every source returns what a `models.Predictor` returns: [B, K, A+1]
probabilities over `agent_names` plus END (last), for a batch of live workflows."""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol, Sequence

import torch

from models.base import WorkflowPrefix, vocabulary

END = "END"  # the end of a workflow in an agent graph's successor lists


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


class AgentStepGraph:
    """KVFlow's view (Pan et al., arXiv 2507.07400): the Agent Step Graph of the workflow's
    definition, and each agent's steps-to-execution from where a workflow stands in it.

    Two kinds of graph (a generated dataset declares its own in meta.json, data/generators.py):

        {"kind": "pipeline", "steps": [a1, a2, ...]}    a static pipeline: after n calls the
            workflow is at step n, and agent a executes in (first j >= n with steps[j] = a) - n + 1 steps;
        {"kind": "transitions", "start": [...], "next": {a: [b, ..., "END"]}}    a dynamic workflow's
            possible transitions: a executes at the earliest in the length of the shortest path
            from the last agent to a (KVFlow takes the nearest of the branches).

    Imported traces declare none: `from_traces` takes every transition seen in the train split.
    `predict` gives the distributions KVFlow's prefetch reads (the pipeline's next steps; a
    uniform choice among a dynamic graph's successors); `steps_to_execution` gives its eviction order."""

    def __init__(self, graph: dict, horizon: int, agent_names: list[str] | None = None, origin: str = "declared"):
        kind = graph.get("kind")
        if kind == "pipeline":
            self.steps = list(graph["steps"])
            agents = set(self.steps)
        elif kind == "transitions":
            self.next = {a: list(dict.fromkeys(bs)) for a, bs in graph["next"].items()}
            agents = set(self.next) | {b for bs in self.next.values() for b in bs} | set(graph.get("start", ()))
            agents.discard(END)
        else:
            raise ValueError(f"agent graph kind must be 'pipeline' or 'transitions'; got {kind!r}")
        self.graph, self.kind, self.horizon, self.origin = graph, kind, horizon, origin
        self.agent_names = agent_names or vocabulary(agents)
        self._distances: dict[str, dict[str, int]] = {}

    @classmethod
    def from_traces(cls, train_workflows: Sequence[Sequence[str]], horizon: int,
                    agent_names: list[str] | None = None) -> "AgentStepGraph":
        """Every transition seen in the (train) traces, END included."""
        successors: dict[str, dict[str, None]] = defaultdict(dict)
        for agents in train_workflows:
            for a, b in zip(agents, list(agents[1:]) + [END]):
                successors[a][b] = None
        graph = {"kind": "transitions", "start": sorted({a[0] for a in train_workflows if a}),
                 "next": {a: sorted(bs) for a, bs in sorted(successors.items())}}
        return cls(graph, horizon, agent_names, origin="train transitions")

    @classmethod
    def for_dataset(cls, meta: dict, train_workflows: Sequence[Sequence[str]], horizon: int,
                    agent_names: list[str] | None = None) -> "AgentStepGraph":
        """The dataset's declared graph (meta.json `agent_graph`), else the train split's transitions."""
        if meta.get("agent_graph"):
            return cls(meta["agent_graph"], horizon, agent_names)
        return cls.from_traces(train_workflows, horizon, agent_names)

    def distances_from(self, agent: str) -> dict[str, int]:
        """Shortest path lengths (>= 1) from `agent` to every agent reachable (breadth-first)."""
        if agent not in self._distances:
            out, frontier, depth = {}, [agent], 0
            while frontier:
                depth += 1
                nxt = []
                for a in frontier:
                    for b in self.next.get(a, ()):
                        if b != END and b not in out:
                            out[b] = depth
                            nxt.append(b)
                frontier = nxt
            self._distances[agent] = out
        return self._distances[agent]

    def steps_of(self, workflow: LiveWorkflow) -> dict[str, int]:
        if self.kind == "pipeline":
            at, out = len(workflow.agents), {}
            for j, a in enumerate(self.steps[at:], start=1):
                out.setdefault(a, j)
            return out
        return dict(self.distances_from(workflow.agents[-1]))

    def steps_to_execution(self, workflows: Sequence[LiveWorkflow]) -> list[dict[str, int]]:
        return [self.steps_of(w) for w in workflows]

    def predict(self, workflows):
        if self.kind == "pipeline":
            return _one_hot_paths([self.steps[len(w.agents):len(w.agents) + self.horizon] for w in workflows],
                                  self.agent_names, self.horizon)
        index = {a: i for i, a in enumerate(self.agent_names)}
        end = len(self.agent_names)
        out = torch.zeros(len(workflows), self.horizon, end + 1)
        for b, w in enumerate(workflows):
            state = {w.agents[-1]: 1.0}  # where the workflow is, given it is still running
            for k in range(self.horizon):
                step: dict[str, float] = defaultdict(float)
                for a, p in state.items():
                    successors = self.next.get(a) or [END]
                    for s in successors:
                        step[s] += p / len(successors)
                for s, p in step.items():
                    out[b, k, index.get(s, 0) if s != END else end] += p
                alive = 1.0 - step.get(END, 0.0)
                if alive <= 0:
                    out[b, k + 1:, end] = 1.0
                    break
                state = {a: p / alive for a, p in step.items() if a != END}
        return out


class NoisySource:
    """P' = (1 - eps) P + eps R, R drawn uniformly from the simplex (seeded): prediction error of a
    controlled size, for robustness sweeps."""

    def __init__(self, inner: PredictionSource, eps: float, seed: int):
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"predictor.noise must be in [0, 1]; got {eps}")
        self.inner, self.eps = inner, eps
        self.agent_names, self.horizon = inner.agent_names, inner.horizon
        self.generator = torch.Generator().manual_seed(seed)

    def predict(self, workflows):
        probs = self.inner.predict(workflows)
        if self.eps == 0:
            return probs
        # normalised Exp(1) draws are uniform on the simplex
        noise = torch.empty(probs.shape, dtype=torch.float64).exponential_(generator=self.generator)
        noise = noise / noise.sum(dim=-1, keepdim=True)
        return (1 - self.eps) * probs + self.eps * noise.to(probs.dtype)
