"""LightningDataModule over a trace dataset: one example per agent call.

The example for call t of a workflow with T calls is the prefix up to and including that call
(its last ``max_path`` agents, the call count, the text signal), K labels: the agent of call
t+k, END when t+k = T, and IGNORE_INDEX (masked) past the end, and K times: the seconds until
call t+k arrives (models/timing.py; NaN where that call does not exist).

The vocabulary, the call graph and the Markov counts come from the training split only; agents
that appear only in val/test map to ``<unk>`` in the examples (predictors that embed agents by
identity give them their own vector at predict time, from ``agent_texts``: name and system
prompt, data.store.TraceDataset.system_prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from data import store
from data.knobs import build
from data.schema import SPLITS
from models.base import IGNORE_INDEX, UNK_ID, vocabulary
from models.graph import CallGraph
from models.text import TextFeatures, TextSpec, agent_identity_text
from models.timing import times_until, workflow_gaps


@dataclass
class Workflow:
    agents: list[str]
    task: str
    hidden: list[list[float]] = field(default_factory=list)  # one per call; [] where absent
    tool_time: list[float | None] = field(default_factory=list)  # the trace's time columns, one per call
    start_time: list[float | None] = field(default_factory=list)
    end_time: list[float | None] = field(default_factory=list)

    def gaps(self, source: str) -> list[float]:
        """Each call's gap in seconds (models.timing.workflow_gaps)."""
        return workflow_gaps(self.tool_time, self.start_time, self.end_time, source)


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
    # when the calls arrive: the time knobs, where the gaps come from (models.timing.TIME_SOURCES) and
    # each training call's gap (aligned with train_sequences)
    time: "TimeConfig | None" = None
    time_source: str = "none"
    train_gaps: list[list[float]] = field(default_factory=list)


class Examples(TensorDataset):
    """A split's examples, one row of each tensor per example. A DataLoader reads a batch as one
    gather per tensor (`__getitems__`, with `as_batch` as its collate_fn), where a TensorDataset is
    read one example at a time and the rows stacked again: the same tensors, without a Python call
    per example (graphsage's fit on 1,000 hover workflows: 12.1 s against 13.6, the same weights)."""

    def __getitems__(self, indices: list[int]) -> list[Tensor]:
        rows = torch.tensor(indices, dtype=torch.long)
        return [tensor[rows] for tensor in self.tensors]


def as_batch(batch: list[Tensor]) -> list[Tensor]:
    """The DataLoader's collate_fn for `Examples`: its gathered rows are the batch already, a list
    of tensors as default_collate makes of a batch of tuples."""
    return batch


def workflows_of(calls) -> list[Workflow]:
    """Group a split's rows (already grouped by workflow, in step order) into workflows."""
    names = ["workflow_id", "agent", "task", "hidden", "tool_time", "start_time", "end_time"]
    columns = calls.select_columns([n for n in names if n in calls.column_names]).to_dict()
    none = [None] * len(columns["agent"])
    workflows: list[Workflow] = []
    last_id = None
    for wid, agent, task, hidden, tool, start, end in zip(*(columns.get(n, none) for n in names)):
        if wid != last_id:
            workflows.append(Workflow([], task))
            last_id = wid
        wf = workflows[-1]
        wf.agents.append(agent)
        wf.hidden.append(hidden or [])
        wf.tool_time.append(tool)
        wf.start_time.append(start)
        wf.end_time.append(end)
    return workflows


def training_time_source(train: Sequence[Workflow]) -> str:
    """Where the gaps come from (models.timing.TIME_SOURCES), decided on the training split: any
    positive tool_time, else start and end times on every call with some positive gap, else none."""
    if any(g is not None and g > 0 for wf in train for g in wf.tool_time):
        return "tool_time"
    stamped = all(s is not None and e is not None for wf in train for s, e in zip(wf.start_time, wf.end_time))
    if stamped and any(g > 0 for wf in train for g in wf.gaps("timestamps")):
        return "timestamps"
    return "none"


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
                 time=None, **knobs):
        """`horizon`, `seed`, `time` (a TimeConfig or its mapping; None: its defaults): train.py's root
        knobs; `knobs`: max_path, batch_size, text_source (models.config.DataModuleConfig, their
        defaults and ranges)."""
        from models.config import DataModuleConfig, TimeConfig

        super().__init__()
        if data is None and dataset is None:
            raise ValueError("TraceDataModule needs a data config or a loaded dataset")
        config = DataModuleConfig(horizon=horizon, seed=seed, **knobs)
        self.data_cfg, self.dataset = data, dataset
        self.horizon, self.max_path, self.batch_size = config.horizon, config.max_path, config.batch_size
        self.text_source, self.text_encoder, self.seed = config.text_source, text_encoder, config.seed
        self.hidden_dim = config.hidden_dim
        self.time = time if isinstance(time, TimeConfig) else build(time or {}, TimeConfig, "time")
        self.corpus: Corpus | None = None
        self.splits: dict[str, Examples] = {}

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
        source = training_time_source(workflows["train"])
        self.corpus.time, self.corpus.time_source = self.time, source
        self.corpus.train_gaps = [wf.gaps(source) for wf in workflows["train"]]
        task_vectors = self.encode_tasks(workflows, text)
        path_index = {**index, **{a: len(index) + 1 + j for j, a in enumerate(unseen)}}  # past END
        self.splits = {split: self.examples(wfs, index, path_index, text, task_vectors, source)
                       for split, wfs in workflows.items()}

    def encode_tasks(self, workflows: dict[str, list[Workflow]], text: TextSpec) -> dict[str, Tensor]:
        if text.source != "encoder":
            return {}
        tasks = list(dict.fromkeys(wf.task for wfs in workflows.values() for wf in wfs))
        return dict(zip(tasks, self.text_encoder.encode(tasks)))

    def examples(self, workflows: list[Workflow], index: dict[str, int], path_index: dict[str, int],
                 text: TextSpec, task_vectors: dict[str, Tensor], source: str = "none") -> Examples:
        """Paths name agents by path_index (unseen ones past the vocabulary), labels by index
        (unseen ones are <unk>), times from the gaps of `source`."""
        end, width, horizon = len(index), self.max_path, self.horizon
        paths, n_calls, labels, texts, times = [], [], [], [], []
        for wf in workflows:
            times.append(times_until(wf.gaps(source), horizon))
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
        times = torch.from_numpy(np.concatenate(times)).float() if times else torch.zeros(0, horizon)
        return Examples(torch.tensor(paths, dtype=torch.long).view(-1, width),
                        torch.tensor(n_calls, dtype=torch.long), texts,
                        torch.tensor(labels, dtype=torch.long).view(-1, horizon), times)

    @staticmethod
    def text_vector(wf: Workflow, t: int, text: TextSpec, task_vectors: dict[str, Tensor]) -> Tensor:
        if text.source == "encoder":
            return task_vectors[wf.task]
        if text.source == "hidden" and len(wf.hidden[t]) == text.input_size:
            return torch.tensor(wf.hidden[t], dtype=torch.float32)
        return torch.zeros(text.input_size)  # no text signal (or a call without a hidden state)

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.splits[split], batch_size=self.batch_size, shuffle=shuffle, generator=generator,
                          collate_fn=as_batch)

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.loader("test")
