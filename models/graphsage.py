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

Agent identity (``identity=True``): an agent is also what identifies it in a real framework, its
name and system prompt, embedded by the text encoder (models.text.agent_identity_text). With
:math:`x_a` that vector (zero for ``<unk>`` and END) and a learnt projection :math:`W_{id}`, the
GNN's input and the state of an agent u outside the vocabulary are

.. math::
    X_a = E_a + W_{id} x_a, \qquad
    H_u = \mathrm{GNN}(W_{id} x_u, \varnothing)

(u as a node of its own with no edges: the call graph only knows the training agents), so an
unseen agent's path token is :math:`H_u + p_j` instead of ``<unk>``'s. Training replaces a share
``identity_dropout`` of the path's agent tokens by their edge-less identity state
:math:`\mathrm{GNN}(W_{id} x_a, \varnothing)`, so that the head learns to read it. The output
classes stay the vocabulary (an unseen next agent is ``<unk>``; the serving side's online backoff
learns it by name, serving_integration/cache/predictions.py). Identity vectors of the training
agents are part of the checkpoint (``identity_vectors`` with ``agent_texts``); an unseen agent is
encoded when first met, from its name alone unless its system prompt was given
(:meth:`GraphPathPredictor.describe_agents`).

Time until the next calls (models/timing.py): a head reads the fused vector, detached so that its
pinball loss trains only the head, and adds to the per-agent empirical log-time quantiles of the
current agent (its last layer starts at zero: before training it predicts that table exactly),

.. math::
    z = \mathrm{sort}\bigl(\log(\tau_{agent}(a_t) + c) + \mathrm{MLP_{time}}(\mathrm{sg}[h_{cur}; h_{path}; h_{txt}])\bigr)
    \in \mathbb{R}^{K \times Q}

It is built last and without drawing from the global random stream (models.timing.fresh_rng_head),
so the next-agent layers start, drop out and train exactly as without it. Without gaps in the
training traces there is no head: the times are the per-agent table.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import MLP, RGCNConv, SAGEConv

from models.base import PrefixBatch, Predictor
from models.config import GraphSAGEConfig, RGCNConfig, hyperparameters
from models.graph import RELATIONS, CallGraph
from models.text import TEXT_CACHE_SIZE, TextFeatures, TextSpec, agent_identity_text
from models.timing import TimeSpec, fresh_rng_head, time_head, timed


class GraphPathPredictor(Predictor):
    """h_cur from a GNN over the call graph, h_path by attention, h_txt by projection."""

    Config = GraphSAGEConfig  # the hyper-parameters (dim, hidden, layers, ..., identity): their defaults and ranges

    def __init__(self, agent_names, horizon: int, graph: dict, text: dict | None = None, max_path: int | None = None,
                 text_cache_size: int = TEXT_CACHE_SIZE, agent_texts: list[str] | None = None,
                 identity_encoder: dict | None = None, time: dict | None = None, **knobs):
        super().__init__(agent_names, horizon, text, max_path, text_cache_size, time)
        self.config = self.Config(**knobs)
        self.hparams = hyperparameters(self.config)
        dim, hidden, layers, identity = self.config.dim, self.config.hidden, self.config.layers, self.config.identity
        max_steps, dropout, use_text = self.config.max_steps, self.config.dropout, self.config.use_text
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
        self.identity_proj = None
        if identity:
            if not identity_encoder or agent_texts is None or len(agent_texts) != len(self.agent_names):
                raise ValueError(
                    f"identity=True needs identity_encoder (a text encoder spec, got {identity_encoder!r}) and "
                    f"agent_texts, one per vocabulary entry ({len(self.agent_names)}, got "
                    f"{None if agent_texts is None else len(agent_texts)}): the checkpoint lacks the agents' "
                    f"identity texts; retrain it, or build it with identity=False")
            self.agent_texts = list(agent_texts)
            self.identity_encoder = dict(identity_encoder)
            spec = TextSpec("encoder", int(identity_encoder["dim"]), self.identity_encoder)
            self.identity_features = TextFeatures(spec, text_cache_size)  # unseen agents' texts, LRU-cached
            self.register_buffer("identity_vectors", torch.zeros(self.n_classes, spec.dim))  # x_a, in checkpoints
            self.identity_proj = nn.Linear(spec.dim, dim, bias=False)
            self._descriptions: dict[str, str] = {}  # unseen agents' system prompts (describe_agents)
            self._unseen: dict[str, int] = {}  # agents outside the vocabulary met so far -> row of _unseen_vectors
            self._unseen_vectors = torch.zeros(0, spec.dim)
        self.time_head = fresh_rng_head(lambda: time_head(3 * dim, self.time_spec, horizon))  # last: see the docstring

    @classmethod
    def from_corpus(cls, corpus, **knobs) -> "GraphPathPredictor":
        identity = cls.Config(**knobs).identity
        if identity and corpus.agent_vectors is None:
            raise ValueError("identity=True embeds agents by name and system prompt with the text encoder; "
                             "the corpus has none (set model/text_encoder)")
        predictor = cls(corpus.agent_names, corpus.horizon, graph=corpus.graph.to_dict(), text=corpus.text.to_dict(),
                        max_path=corpus.max_path, agent_texts=corpus.agent_texts if identity else None,
                        identity_encoder=corpus.identity_encoder if identity else None,
                        time=TimeSpec.from_corpus(corpus).to_dict(), **knobs)
        if identity:
            with torch.no_grad():
                vectors = torch.as_tensor(corpus.agent_vectors, dtype=torch.float32)
                predictor.identity_vectors[1:len(vectors)] = vectors[1:]  # <unk> and END keep zeros
            # the val/test agents the examples name past the vocabulary, in the corpus's order
            predictor.register_unseen(corpus.unseen_agents, corpus.unseen_vectors)
        return predictor

    def init_args(self) -> dict:
        args = {"agent_names": self.agent_names, "horizon": self.horizon, "graph": self.graph.to_dict(),
                "text": self.text_spec.to_dict(), "max_path": self.max_path, **self.hparams, **self.time_init_args()}
        if self.identity_proj is not None:
            args.update(agent_texts=self.agent_texts, identity_encoder=self.identity_encoder)
        return args

    # ------------------------------------------------------------------ agent identity
    def describe_agents(self, system_prompts: dict[str, str]) -> None:
        """System prompts of agents outside the vocabulary, for their identity text (without
        one, an unseen agent is embedded by its name alone). Takes effect for agents not met yet."""
        if self.identity_proj is not None:
            self._descriptions.update(system_prompts)

    def register_unseen(self, names, vectors=None) -> None:
        """Give agents outside the vocabulary ids n_classes + j (in order of arrival) and identity
        vectors x_u (encoded here from name and described system prompt unless given)."""
        names = list(names)
        new = [n for n in dict.fromkeys(names) if n not in self._unseen and n not in self._agent_index]
        if not new:
            return
        if vectors is None:
            texts = [agent_identity_text(n, self._descriptions.get(n, "")) for n in new]
            vectors = self.identity_encoder_instance().encode(texts)
        else:
            vectors = torch.as_tensor(vectors, dtype=torch.float32)[[names.index(n) for n in new]]
        for name in new:
            self._unseen[name] = len(self._unseen)
        self._unseen_vectors = torch.cat([self._unseen_vectors, vectors.float().cpu()])

    def identity_encoder_instance(self):
        """The encoder of agent identities: the task text's when it is the same (loaded once)."""
        if self.text_spec.encoder == self.identity_encoder:
            return self.text_features.encoder
        return self.identity_features.encoder

    def encode_unseen(self, ids, names):
        """Unseen agents get ids n_classes + j and the batch carries the identity vectors x_u."""
        if self.identity_proj is None:
            return super().encode_unseen(ids, names)
        missing = np.flatnonzero(ids < 0)
        self.register_unseen(names[i] for i in missing)
        ids[missing] = [self.n_classes + self._unseen[names[i]] for i in missing]
        return self._unseen_vectors

    def example_batch(self, path: Tensor, n_calls: Tensor, text: Tensor) -> PrefixBatch:
        if self.identity_proj is None:
            return super().example_batch(path, n_calls, text)
        return PrefixBatch(path, n_calls, text, self._unseen_vectors.to(path.device))

    def identity_states(self, vectors: Tensor) -> Tensor:
        """GNN(W_id x, no edges) [M, d]: the state of agents as nodes of their own."""
        x = self.identity_proj(vectors)
        for i, conv in enumerate(self.convs):
            x = self.isolated(conv, x)
            if i < len(self.convs) - 1:
                x = x.relu()
        return x

    def isolated(self, conv: nn.Module, x: Tensor) -> Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ graph encoder
    def make_conv(self, dim: int) -> nn.Module:
        raise NotImplementedError

    def conv(self, conv: nn.Module, x: Tensor) -> Tensor:
        raise NotImplementedError

    def node_states(self) -> Tensor:
        """H [A+1, d]: the GNN layers over the call graph."""
        x = self.node_embedding.weight
        if self.identity_proj is not None:
            x = x + self.identity_proj(self.identity_vectors)
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
        per_node = weights.new_zeros(len(weights), len(t["value_nodes"])).scatter_add_(1, batch.path, weights)
        per_position = weights.new_zeros(len(weights), len(t["value_positions"])).scatter_add_(1, positions, weights)
        return per_node @ t["value_nodes"] + per_position @ t["value_positions"]

    def with_identities(self, t: dict[str, Tensor], batch: PrefixBatch) -> tuple[dict[str, Tensor], PrefixBatch]:
        """Tables extended by identity states past the vocabulary's n_classes rows: the batch's
        unseen agents (serving), or in training every agent's, with a share identity_dropout of
        the path's agent tokens pointed at them."""
        if self.training:
            vectors = self.identity_vectors
            agents = (batch.path > 0) & (batch.path < self.end_index) & batch.mask
            drop = agents & (torch.rand(batch.path.shape, device=batch.path.device) < self.hparams["identity_dropout"])
            batch = PrefixBatch(torch.where(drop, batch.path + self.n_classes, batch.path), batch.n_calls, batch.text)
        elif batch.unseen is not None and len(batch.unseen):
            vectors = batch.unseen
        else:
            return t, batch
        states = self.identity_states(vectors)
        t = dict(t, nodes=torch.cat([t["nodes"], states]))
        for name, proj in (("query", self.query), ("key", self.key), ("value", self.value)):
            t[f"{name}_nodes"] = torch.cat([t[f"{name}_nodes"], proj(states)])
        return t, batch

    def fused(self, batch: PrefixBatch) -> Tensor:
        """[h_cur; h_path; h_txt] [B, 3d], what the heads read."""
        t = self.lookup_tables()
        if self.identity_proj is not None:
            t, batch = self.with_identities(t, batch)
        h_cur = t["nodes"][batch.path[:, -1]]
        zeros = torch.zeros_like(h_cur)
        h_path = self.path_attention(t, batch) if self.hparams["use_path"] else zeros
        h_txt = self.text_proj(batch.text) if self.text_proj is not None else zeros
        h_cur = h_cur if self.hparams["use_cur"] else zeros
        return torch.cat([h_cur, h_path, h_txt], dim=-1)

    def forward(self, batch: PrefixBatch) -> Tensor:
        return self.head(self.fused(batch)).view(-1, self.horizon, self.n_classes)

    def forward_with_time(self, batch: PrefixBatch) -> tuple[Tensor, Tensor]:
        fused = self.fused(batch)
        logits = self.head(fused).view(-1, self.horizon, self.n_classes)
        if self.time_head is None:
            return logits, self.agent_log_time(batch)
        return logits, timed(self.time_head, fused, self.agent_log_time(batch))



class GraphSAGEPredictor(GraphPathPredictor):
    """SAGEConv with a weighted mean over successors: h_a <- W_1 h_a + W_2 sum_b P(b | a) h_b."""

    family = "graphsage"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("successors", self.graph.successor_weights(), persistent=False)

    def make_conv(self, dim: int) -> nn.Module:
        return SAGEConv(dim, dim, aggr="sum")  # the sparse weights already sum to one per row

    def isolated(self, conv: nn.Module, x: Tensor) -> Tensor:
        return conv(x, x.new_zeros(2, 0, dtype=torch.long))  # no neighbours: W_2 sum is zero

    def conv(self, conv: nn.Module, x: Tensor) -> Tensor:
        with warnings.catch_warnings():  # torch calls sparse CSR "beta"; this product is all we use it for
            warnings.simplefilter("ignore", UserWarning)
            adjacency = self.successors.to_sparse_csr()
        return conv(x, adjacency)


class RGCNPredictor(GraphPathPredictor):
    """RGCNConv: h_a <- W_0 h_a + sum_r mean_{b in N_r(a)} W_r h_b over the relations of
    models.graph.RELATIONS (next, previous, loop_back, co_occurs)."""

    family = "rgcn"
    Config = RGCNConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("relation_index", self.graph.relation_index, persistent=False)
        self.register_buffer("relation_type", self.graph.relation_type, persistent=False)

    def make_conv(self, dim: int) -> nn.Module:
        return RGCNConv(dim, dim, num_relations=len(RELATIONS), num_bases=self.config.num_bases, aggr="mean")

    def conv(self, conv: nn.Module, x: Tensor) -> Tensor:
        return conv(x, self.relation_index, self.relation_type)

    def isolated(self, conv: nn.Module, x: Tensor) -> Tensor:
        empty = x.new_zeros(2, 0, dtype=torch.long)
        return conv(x, empty, empty[0])  # no relations: the root weight W_0 only
