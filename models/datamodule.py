"""LightningDataModule over a trace dataset: one example per agent call.

The example for call t of a workflow with T calls is the prefix up to and including that call
(its last ``max_path`` agents, the call count, the text signal) and K labels: the agent of call
t+k, END when t+k = T, and IGNORE_INDEX (masked) past the end.

The vocabulary, the call graph and the Markov counts come from the training split only; agents
that appear only in val/test map to ``<unk>`` in the examples (predictors that embed agents by
identity give them their own vector at predict time, from ``agent_texts``: name and system
prompt, data.store.TraceDataset.system_prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from data import store
from data.schema import SPLITS
from models.base import IGNORE_INDEX, UNK_ID, vocabulary
from models.graph import CallGraph
from models.text import TextFeatures, TextSpec, agent_identity_text


@dataclass
class Workflow:
    agents: list[str]
    task: str
    hidden: list[list[float]] = field(default_factory=list)  # one per call; [] where absent


@dataclass
class Corpus:
    """What a predictor is built from: vocabulary, training sequences, call graph, text spec."""

    agent_names: list[str]
    horizon: int
    max_path: int
    train_sequences: list[list[int]]
    graph: CallGraph
    text: TextSpec
    workload: str = ""
    # identity text of each vocabulary entry (name + system prompt; "" for <unk>), its encoding by
    # the text encoder [A, D] and that encoder's spec (None without an encoder)
    agent_texts: list[str] = field(default_factory=list)
    agent_vectors: Tensor | None = None
    identity_encoder: dict | None = None
    # agents of val/test outside the vocabulary: the examples' paths name them n_classes + j (their
    # labels are <unk>), with their identity vectors [M, D]
    unseen_agents: list[str] = field(default_factory=list)
    unseen_vectors: Tensor | None = None


def workflows_of(calls) -> list[Workflow]:
    """Group a split's rows (already grouped by workflow, in step order) into workflows."""
    columns = calls.select_columns(["workflow_id", "agent", "task", "hidden"]).to_dict()
    workflows: list[Workflow] = []
    last_id = None
    for wid, agent, task, hidden in zip(columns["workflow_id"], columns["agent"], columns["task"],
                                        columns["hidden"]):
        if wid != last_id:
            workflows.append(Workflow([], task))
            last_id = wid
        workflows[-1].agents.append(agent)
        workflows[-1].hidden.append(hidden or [])
    return workflows


def text_source_of(train: Sequence[Workflow], requested: str, encoder, hidden_dim: int | None = None,
                   seed: int = 0) -> TextSpec:
    """auto: the trace's hidden vectors if every training call has one of one size, else the encoder.
    With hidden vectors and `hidden_dim` other than their size, a projection seeded by `seed`."""
    dims = {len(h) for wf in train for h in wf.hidden}
    has_hidden = len(dims) == 1 and 0 not in dims
    if requested == "hidden" or (requested == "auto" and has_hidden):
        if not has_hidden:
            raise ValueError(f"text_source=hidden, but the training calls' hidden sizes are {sorted(dims)}"
                             " (0: calls without one)")
        size = dims.pop()
        if hidden_dim is None or hidden_dim == size:
            return TextSpec("hidden", size)
        return TextSpec("hidden", hidden_dim, hidden_size=size, projection_seed=seed)
    if requested not in ("auto", "encoder", "none"):
        raise ValueError(f"text_source must be auto, hidden, encoder or none, got {requested!r}")
    if encoder is None or requested == "none":
        return TextSpec()
    return TextSpec("encoder", encoder.dim, encoder.spec())


class TraceDataModule(pl.LightningDataModule):
    def __init__(self, horizon: int, seed: int, data: DictConfig | None = None, text_encoder=None, dataset=None,
                 **knobs):
        """`horizon`, `seed`: train.py's root knobs; `knobs`: max_path, batch_size, text_source
        (models.config.DataModuleConfig, their defaults and ranges)."""
        from models.config import DataModuleConfig

        super().__init__()
        if data is None and dataset is None:
            raise ValueError("TraceDataModule needs a data config or a loaded dataset")
        config = DataModuleConfig(horizon=horizon, seed=seed, **knobs)
        self.data_cfg, self.dataset = data, dataset
        self.horizon, self.max_path, self.batch_size = config.horizon, config.max_path, config.batch_size
        self.text_source, self.text_encoder, self.seed = config.text_source, text_encoder, config.seed
        self.hidden_dim = config.hidden_dim
        self.corpus: Corpus | None = None
        self.splits: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is not None:  # idempotent: train.py builds the corpus before the Trainer runs
            return
        if self.dataset is None:
            self.dataset = store.resolve(self.data_cfg)
        workflows = {split: workflows_of(self.dataset.calls[split]) for split in SPLITS}
        if not workflows["train"]:
            raise ValueError("the training split has no workflows")
        agent_names = vocabulary(a for wf in workflows["train"] for a in wf.agents)
        index = {name: i for i, name in enumerate(agent_names)}
        sequences = [[index[a] for a in wf.agents] for wf in workflows["train"]]
        text = text_source_of(workflows["train"], self.text_source, self.text_encoder, self.hidden_dim, self.seed)
        # identities: an agent's system prompt comes with its calls, so val/test agents have one too
        prompts = self.dataset.system_prompts(None)
        unseen = sorted({a for split in ("val", "test") for wf in workflows[split] for a in wf.agents} - set(index))
        texts = [""] + [agent_identity_text(a, prompts.get(a, "")) for a in agent_names[1:] + unseen]
        encoder = self.text_encoder
        vectors = None if encoder is None else encoder.encode(texts)
        self.corpus = Corpus(agent_names, self.horizon, self.max_path, sequences,
                             CallGraph.from_sequences(sequences, len(agent_names)), text,
                             str(self.dataset.meta.get("workload", "")), texts[:len(agent_names)],
                             None if vectors is None else vectors[:len(agent_names)],
                             None if encoder is None else encoder.spec(),
                             unseen, None if vectors is None else vectors[len(agent_names):])
        task_vectors = self.encode_tasks(workflows, text)
        path_index = {**index, **{a: len(index) + 1 + j for j, a in enumerate(unseen)}}  # past END
        self.splits = {split: self.examples(wfs, index, path_index, text, task_vectors)
                       for split, wfs in workflows.items()}

    def encode_tasks(self, workflows: dict[str, list[Workflow]], text: TextSpec) -> dict[str, Tensor]:
        if text.source != "encoder":
            return {}
        tasks = list(dict.fromkeys(wf.task for wfs in workflows.values() for wf in wfs))
        return dict(zip(tasks, self.text_encoder.encode(tasks)))

    def examples(self, workflows: list[Workflow], index: dict[str, int], path_index: dict[str, int],
                 text: TextSpec, task_vectors: dict[str, Tensor]) -> TensorDataset:
        """Paths name agents by path_index (unseen ones past the vocabulary), labels by index
        (unseen ones are <unk>)."""
        end, width, horizon = len(index), self.max_path, self.horizon
        paths, n_calls, labels, texts = [], [], [], []
        for wf in workflows:
            ids = [path_index.get(a, UNK_ID) for a in wf.agents]
            targets = [index.get(a, UNK_ID) for a in wf.agents] + [end] + [IGNORE_INDEX] * horizon
            for t in range(len(ids)):
                window = ids[max(0, t + 1 - width):t + 1]
                paths.append([UNK_ID] * (width - len(window)) + window)
                n_calls.append(t + 1)
                labels.append(targets[t + 1:t + 1 + horizon])
                texts.append(self.text_vector(wf, t, text, task_vectors))
        texts = torch.stack(texts) if texts else torch.zeros(0, text.input_size)
        if text.projection_seed is not None:  # the predictor's fixed projection (models.text), applied once
            texts = TextFeatures(text).project(texts)
        return TensorDataset(torch.tensor(paths, dtype=torch.long).view(-1, width),
                             torch.tensor(n_calls, dtype=torch.long), texts,
                             torch.tensor(labels, dtype=torch.long).view(-1, horizon))

    @staticmethod
    def text_vector(wf: Workflow, t: int, text: TextSpec, task_vectors: dict[str, Tensor]) -> Tensor:
        if text.source == "encoder":
            return task_vectors[wf.task]
        if text.source == "hidden" and len(wf.hidden[t]) == text.input_size:
            return torch.tensor(wf.hidden[t], dtype=torch.float32)
        return torch.zeros(text.input_size)  # no text signal (or a call without a hidden state)

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.splits[split], batch_size=self.batch_size, shuffle=shuffle, generator=generator)

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.loader("test")
