"""The global call graph G built from the training traces (docs/predictors.md).

Nodes are the vocabulary's agents (``<unk>`` included) plus END; the weight of edge a -> b is the
number of observed transitions from a call of a to a call of b (b = END when a closed the
workflow). GraphSAGE aggregates over the row-normalised transition matrix; R-GCN over typed
relations derived from the same traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# R-GCN relation types. Messages flow *into* the node named first: a node hears from the
# agents that follow it, precede it, that it loops back to, and that share a workflow with it.
RELATIONS = ("next", "previous", "loop_back", "co_occurs")


@dataclass
class CallGraph:
    transitions: Tensor  # [N, N] float counts, N = agents + END
    relation_index: Tensor  # [2, E] long (source, target) message edges for R-GCN
    relation_type: Tensor  # [E] long, index into RELATIONS

    @property
    def n_nodes(self) -> int:
        return self.transitions.shape[0]

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], n_agents: int) -> "CallGraph":
        """sequences: agent ids of each training workflow in call order; END = n_agents."""
        end = n_agents
        counts = torch.zeros(end + 1, end + 1)
        relations: set[tuple[int, int, int]] = set()
        for seq in sequences:
            for i, (a, b) in enumerate(zip(seq, list(seq[1:]) + [end])):
                counts[a, b] += 1
                relations.add((b, a, RELATIONS.index("next")))
                relations.add((a, b, RELATIONS.index("previous")))
                if b in seq[:i + 1]:  # a retry: control returns to an agent this workflow already ran
                    relations.add((b, a, RELATIONS.index("loop_back")))
            members = set(seq)
            relations.update((a, b, RELATIONS.index("co_occurs")) for a in members for b in members if a != b)
        edges = sorted(relations)
        index = torch.tensor([[s for s, _, _ in edges], [t for _, t, _ in edges]], dtype=torch.long).view(2, -1)
        kind = torch.tensor([r for _, _, r in edges], dtype=torch.long)
        return cls(counts, index, kind)

    def successor_weights(self) -> Tensor:
        """Row-normalised transitions, W[a, b] = P(next = b | current = a) (zero rows stay zero)."""
        totals = self.transitions.sum(dim=1, keepdim=True)
        return self.transitions / totals.clamp(min=1.0)

    def to_dict(self) -> dict:
        return {"transitions": self.transitions, "relation_index": self.relation_index,
                "relation_type": self.relation_type, "relations": list(RELATIONS)}

    @classmethod
    def from_dict(cls, d: dict) -> "CallGraph":
        if list(d.get("relations", RELATIONS)) != list(RELATIONS):
            raise ValueError(f"call graph relations {d['relations']} differ from this code's {list(RELATIONS)}")
        return cls(d["transitions"].float(), d["relation_index"].long(), d["relation_type"].long())
