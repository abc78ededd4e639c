"""Graph predictors: GraphSAGE (the paper's, section 4.1) and R-GCN over the global call graph.

Three signals, fused by an MLP into K x (A+1) logits:

.. math::
    H = \\mathrm{GNN}(X, G), \\quad
    h_{cur} = H_{a_t}, \\quad
    h_{path} = \\mathrm{softmax}\\Bigl(\\frac{q K^\\top}{\\sqrt d}\\Bigr) V, \\quad
    h_{txt} = W_t x_{txt}

    \\mathrm{logits} = \\mathrm{MLP}([h_{cur}; h_{path}; h_{txt}]) \\in \\mathbb{R}^{K \\times (A+1)}

where the path tokens are :math:`H_{a_j} + p_j` (p_j a learnt embedding of the absolute step j),
q comes from the current call's token and K, V from all of them (computed in factorised form,
see :meth:`GraphPathPredictor.path_attention`). The GNN runs on the node embeddings of the
agents and END, so its cost does not depend on the batch; while serving, its outputs and their
projections are computed once and reused. ``use_cur`` / ``use_path`` / ``use_text`` zero one
signal each (ablations).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import MLP, RGCNConv, SAGEConv

from models.base import PrefixBatch, Predictor
from models.graph import RELATIONS, CallGraph


class GraphPathPredictor(Predictor):
    """h_cur from a GNN over the call graph, h_path by attention, h_txt by projection."""

    def __init__(self, agent_names, horizon: int, graph: dict, text: dict | None = None, dim: int = 128,
                 hidden: int = 256, layers: int = 2, max_steps: int = 64, dropout: float = 0.1,
                 use_cur: bool = True, use_path: bool = True, use_text: bool = True, max_path: int = 32,
                 text_cache_size: int = 4096):
        super().__init__(agent_names, horizon, text, max_path, text_cache_size)
        self.hparams = dict(dim=dim, hidden=hidden, layers=layers, max_steps=max_steps, dropout=dropout,
                            use_cur=use_cur, use_path=use_path, use_text=use_text)
        self.graph = CallGraph.from_dict(graph)
        if self.graph.n_nodes != self.n_classes:
            raise ValueError(f"call graph has {self.graph.n_nodes} nodes, the vocabulary needs {self.n_classes}")
        self.node_embedding = nn.Embedding(self.n_classes, dim)
        self.convs = nn.ModuleList(self.make_conv(dim) for _ in range(layers))
        self.position = nn.Embedding(max_steps, dim)
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.text_proj = nn.Linear(self.text_spec.dim, dim) if use_text and self.text_spec.dim else None
        self.head = MLP([3 * dim, hidden, hidden, horizon * self.n_classes], dropout=dropout, norm=None)
        self._tables: dict[str, Tensor] | None = None
        self._tables_key: tuple | None = None

    @classmethod
    def from_corpus(cls, corpus, **hparams) -> "GraphPathPredictor":
        return cls(corpus.agent_names, corpus.horizon, graph=corpus.graph.to_dict(), text=corpus.text.to_dict(),
                   max_path=corpus.max_path, **hparams)

    def init_args(self) -> dict:
        return {"agent_names": self.agent_names, "horizon": self.horizon, "graph": self.graph.to_dict(),
                "text": self.text_spec.to_dict(), "max_path": self.max_path, **self.hparams}

    # ------------------------------------------------------------------ graph encoder
    def make_conv(self, dim: int) -> nn.Module:
        raise NotImplementedError

    def conv(self, conv: nn.Module, x: Tensor) -> Tensor:
        raise NotImplementedError

    def node_states(self) -> Tensor:
        """H [A+1, d]: the GNN layers over the call graph."""
        x = self.node_embedding.weight
        for i, conv in enumerate(self.convs):
            x = self.conv(conv, x)
            if i < len(self.convs) - 1:
                x = x.relu()
        return x

    def lookup_tables(self) -> dict[str, Tensor]:
        """Per-node and per-position parts of the path tokens and their projections.

        A path token is H[a] + P[j], so W (H[a] + P[j]) + b = (W H + b)[a] + (W P)[j]: projecting
        the A+1 nodes and the positions once turns per-token matmuls into gathers. Serving
        (eval, no grad) reuses them until a weight changes, moves or is cast.
        """
        serving = not self.training and not torch.is_grad_enabled()
        key = tuple((p.data_ptr(), p._version) for p in self.parameters())  # moved, cast or updated
        if serving and self._tables is not None and self._tables_key == key:
            return self._tables
        nodes, positions = self.node_states(), self.position.weight
        tables = {"nodes": nodes}
        for name, proj in (("query", self.query), ("key", self.key), ("value", self.value)):
            tables[f"{name}_nodes"] = proj(nodes)
            tables[f"{name}_positions"] = F.linear(positions, proj.weight)
        self._tables, self._tables_key = (tables, key) if serving else (None, None)
        return tables

    # ------------------------------------------------------------------ fusion
    def path_attention(self, t: dict[str, Tensor], batch: PrefixBatch) -> Tensor:
        """softmax(q k_j / sqrt(d)) v_j over the path, in factorised form.

        With k_j = Kn[a_j] + Kp[j] and v_j = Vn[a_j] + Vp[j], the scores are gathers of q Kn^T
        [B, A+1] and q Kp^T [B, P], and the output is (weights summed per node) Vn + (weights
        per position) Vp: no [B, L, d] tensor is built.
        """
        positions = batch.positions.clamp(max=self.position.num_embeddings - 1)
        query = t["query_nodes"][batch.path[:, -1]] + t["query_positions"][positions[:, -1]]
        scores = (query @ t["key_nodes"].T).gather(1, batch.path) \
            + (query @ t["key_positions"].T).gather(1, positions)
        weights = torch.softmax((scores / query.shape[-1] ** 0.5).masked_fill(~batch.mask, float("-inf")), dim=-1)
        per_node = weights.new_zeros(len(weights), self.n_classes).scatter_add_(1, batch.path, weights)
        per_position = weights.new_zeros(len(weights), len(t["value_positions"])).scatter_add_(1, positions, weights)
        return per_node @ t["value_nodes"] + per_position @ t["value_positions"]

    def forward(self, batch: PrefixBatch) -> Tensor:
        t = self.lookup_tables()
        h_cur = t["nodes"][batch.path[:, -1]]
        zeros = torch.zeros_like(h_cur)
        h_path = self.path_attention(t, batch) if self.hparams["use_path"] else zeros
        h_txt = self.text_proj(batch.text) if self.text_proj is not None else zeros
        h_cur = h_cur if self.hparams["use_cur"] else zeros
        return self.head(torch.cat([h_cur, h_path, h_txt], dim=-1)).view(-1, self.horizon, self.n_classes)


class GraphSAGEPredictor(GraphPathPredictor):
    """SAGEConv with a weighted mean over successors: h_a <- W_1 h_a + W_2 sum_b P(b | a) h_b."""

    family = "graphsage"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("successors", self.graph.successor_weights(), persistent=False)

    def make_conv(self, dim: int) -> nn.Module:
        return SAGEConv(dim, dim, aggr="sum")  # the sparse weights already sum to one per row

    def conv(self, conv: nn.Module, x: Tensor) -> Tensor:
        with warnings.catch_warnings():  # torch calls sparse CSR "beta"; this product is all we use it for
            warnings.simplefilter("ignore", UserWarning)
            adjacency = self.successors.to_sparse_csr()
        return conv(x, adjacency)


class RGCNPredictor(GraphPathPredictor):
    """RGCNConv: h_a <- W_0 h_a + sum_r mean_{b in N_r(a)} W_r h_b over the relations of
    models.graph.RELATIONS (next, previous, loop_back, co_occurs)."""

    family = "rgcn"

    def __init__(self, *args, num_bases: int | None = None, **kwargs):
        self._num_bases = num_bases  # read by make_conv during the base constructor
        super().__init__(*args, **kwargs)
        self.hparams["num_bases"] = num_bases
        self.register_buffer("relation_index", self.graph.relation_index, persistent=False)
        self.register_buffer("relation_type", self.graph.relation_type, persistent=False)

    def make_conv(self, dim: int) -> nn.Module:
        return RGCNConv(dim, dim, num_relations=len(RELATIONS), num_bases=self._num_bases, aggr="mean")

    def conv(self, conv: nn.Module, x: Tensor) -> Tensor:
        return conv(x, self.relation_index, self.relation_type)
