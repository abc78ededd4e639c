"""The knobs of data/: one dataclass per component, each field with its one default, its range
and a help line (data.knobs). They are the Hydra schemas of their config groups, registered here:

    conf/workload/*.yaml         HoverConfig, SweBenchConfig, FinanceBenchConfig  (data/generators.py)
    conf/data/*.yaml             GeneratedDataConfig, ImportedDataConfig   (the `data` node of train / evaluate)
    conf/generate.yaml           GenerateConfig                            (python -m data.generate)
    conf/import_traces.yaml      ImportConfig                              (python -m data.import_traces)

A YAML file of these groups starts its defaults list with its schema and holds values and
comments only; an unknown key or a value of the wrong type fails when Hydra composes the config,
a value out of range when the entry point builds the checked object (:func:`data_config`,
``build(cfg, GenerateConfig)``): one line, ``data.split.test=1.0: Input should be less than 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from data.errors import ConfigError
from data.published import located
from data.knobs import (above, at_least, below, broken_rule, build, check, distribution, each, each_value, keys,
                        knob, nonempty, one_of, probability, register, shown)


def _formats():
    from data.readers import FORMATS

    return FORMATS


def _existing_dir(value) -> Optional[str]:
    return None if Path(value).is_dir() else "no such directory"


# ------------------------------------------------------------------ split

@dataclass
class SplitConfig:
    """Seeded assignment of whole workflows to train / val / test (data/store.py)."""

    val: float = knob(0.1, "share of workflows in the validation split", at_least(0), below(1))
    test: float = knob(0.1, "share of workflows in the test split", at_least(0), below(1))
    seed: int = knob(0, "seed of the assignment", at_least(0))

    def __post_init__(self):
        check(self)
        if self.val + self.test >= 1:
            raise broken_rule(self, ("val", "test"), "val + test should be below 1 (the rest is the train split)")

    def needs(self) -> int:
        """Workflows it takes to give train and every split with a share at least one each."""
        return 1 + (self.val > 0) + (self.test > 0)


def too_few(n_workflows: int, split: SplitConfig, key: str) -> None:
    """Generated workflows must fill train and every split with a share (data/store.py splits whole
    workflows): fewer fail here rather than as an empty split later."""
    if n_workflows < split.needs():
        raise ConfigError(f"{key}={n_workflows}: too few to split: train, val and test need {split.needs()} "
                          f"(split.val={split.val}, split.test={split.test})")


# Where what one run builds is kept for the next: datasets (data.cache_dir), trained predictors
# (evaluate.py's predictor.cache_dir) and, in its TEXT_ENCODINGS folder, the MiniLM embeddings of
# their data's texts (models.text.keep_encodings_in; train.py's encodings_dir).
DATA_CACHE = "${oc.env:PBKV_DATA_CACHE,.cache/pbkv/data}"
PREDICTOR_CACHE = "${oc.env:PBKV_PREDICTOR_CACHE,.cache/pbkv/predictors}"
TEXT_ENCODINGS = "text_encodings"


# ------------------------------------------------------------------ workloads (data/generators.py)

MEMORIES = ("per_agent", "transcript")  # what a generated call's prompt resends (data/generators.py)


@dataclass
class WorkloadConfig:
    """What every generated workload shares: the task text's cue, the output lengths, and what each
    call's prompt resends (its agent's own system prompt, or the team's whole conversation)."""

    cue_noise: float = knob(0.1, "share of task texts written for another latent value (weakens the text's cue)",
                            probability)
    template_holdout: bool = knob(True, "split by task template: val / test templates are unseen in train "
                                        "(data/store.py)")
    output_scale: float = knob(1.0, "multiplies every drawn output length (small replays on a CPU server)", above(0))
    memory: str = knob("per_agent", "what a call's prompt resends: per_agent (its agent's system prompt, the task, "
                                    "the transcript so far) or transcript (one system prompt for the team, the task, "
                                    "the whole conversation so far with every turn's hand-over: LangChain / AutoGen-"
                                    "style memory)", one_of(MEMORIES))
    turn_tokens: int = knob(40, "tokens of the message handing the next agent its turn (memory=transcript only)",
                            at_least(1))

    def __post_init__(self):
        check(self)


_TOKENS = each_value(at_least(1))


@dataclass
class HoverConfig(WorkloadConfig):
    """Multi-hop fact checking (data.generators.Hover)."""

    _target_: str = "data.generators.Hover"
    hop_probs: List[float] = knob(None, "P(claim needs 1, 2, 3, 4 ... hops)", nonempty, each(probability),
                                  distribution, factory=lambda: [0.25, 0.35, 0.25, 0.15])
    extra_hop_prob: float = knob(0.15, "the verifier asks for one more hop (scaled by hops / 2)", probability)
    passages_per_search: List[int] = knob(None, "LOW HIGH: passages one search returns, drawn uniformly",
                                          each(at_least(1)), factory=lambda: [4, 10])
    passage_tokens: int = knob(350, "median tokens of one retrieved passage", at_least(1))
    search_seconds: float = knob(1.0, "median seconds of one search (the tool time before the next call)",
                                 at_least(0))
    system_prompt_tokens: Dict[str, int] = knob(
        None, "tokens of each agent's system prompt", keys(("retriever", "summarizer", "query_generator", "verifier")),
        _TOKENS, factory=lambda: {"retriever": 650, "summarizer": 1100, "query_generator": 800, "verifier": 1800})

    def __post_init__(self):
        check(self)
        low_high = self.passages_per_search
        if len(low_high) != 2 or low_high[0] > low_high[1]:
            raise ConfigError(f"passages_per_search={shown(low_high)}: should be LOW HIGH with LOW <= HIGH")


_DIFFICULTIES = ("easy", "medium", "hard")


@dataclass
class SweBenchConfig(WorkloadConfig):
    """Issue fixing with retry loops (data.generators.SweBench)."""

    _target_: str = "data.generators.SweBench"
    difficulty_probs: Dict[str, float] = knob(None, "P(issue difficulty)", keys(_DIFFICULTIES),
                                              each_value(probability), distribution,
                                              factory=lambda: {"easy": 0.35, "medium": 0.4, "hard": 0.25})
    fail_prob: Dict[str, float] = knob(None, "P(a test run fails), per difficulty", keys(_DIFFICULTIES),
                                       each_value(probability),
                                       factory=lambda: {"easy": 0.15, "medium": 0.45, "hard": 0.7})
    max_attempts: int = knob(6, "coder -> tester attempts at most (the last one passes)", at_least(1))
    replan_after: int = knob(3, "failures in a row before the planner is called again", at_least(1))
    test_seconds: float = knob(20.0, "median seconds of one test run", at_least(0))
    system_prompt_tokens: Dict[str, int] = knob(
        None, "tokens of each agent's system prompt", keys(("planner", "coder", "tester", "reviewer")), _TOKENS,
        factory=lambda: {"planner": 2200, "coder": 2800, "tester": 1500, "reviewer": 1200})


_FINANCE_AGENTS = ("retriever", "analyst", "calculator", "writer")


@dataclass
class FinanceBenchConfig(WorkloadConfig):
    """Financial QA, a static pipeline (data.generators.FinanceBench)."""

    _target_: str = "data.generators.FinanceBench"
    type_probs: Dict[str, float] = knob(None, "P(question type)", keys(("lookup", "ratio", "trend")),
                                        each_value(probability), distribution,
                                        factory=lambda: {"lookup": 0.4, "ratio": 0.35, "trend": 0.25})
    retrieval_seconds: float = knob(1.5, "median seconds of one filing search", at_least(0))
    react_steps: Dict[str, int] = knob(None, "LLM calls per agent (its ReAct loop)", keys(_FINANCE_AGENTS),
                                       each_value(at_least(1)),
                                       factory=lambda: {"retriever": 3, "analyst": 1, "calculator": 2, "writer": 1})
    system_prompt_tokens: Dict[str, int] = knob(
        None, "tokens of each agent's system prompt", keys(_FINANCE_AGENTS), _TOKENS,
        factory=lambda: {"retriever": 700, "analyst": 1600, "calculator": 900, "writer": 1000})


WORKLOAD_CONFIGS = {cls._target_: cls for cls in (HoverConfig, SweBenchConfig, FinanceBenchConfig)}


def workload_config(node, prefix: str = "workload") -> WorkloadConfig:
    """A composed workload node as its checked config, chosen by its `_target_`."""
    target = node.get("_target_")
    if target not in WORKLOAD_CONFIGS:
        raise ConfigError(f"{prefix}._target_={target}: should be one of {', '.join(WORKLOAD_CONFIGS)}")
    return build(node, WORKLOAD_CONFIGS[target], prefix)


# ------------------------------------------------------------------ trace sources

@dataclass
class WorkloadDraw:
    """Workflows drawn from a generated workload: data.generate's, and a generated `data.source`."""

    n_workflows: int = knob(1000, "workflows to generate (workflow i of seed s is the same for every n)",
                            at_least(1))
    seed: int = knob(0, "seed of the workload's draws", at_least(0))
    workload: Any = knob(None, "the generator and its knobs (conf/workload/)")

    def __post_init__(self):
        check(self)
        if self.workload is not None and not isinstance(self.workload, WorkloadConfig):
            self.workload = workload_config(self.workload)


@dataclass
class TraceSource:
    """A recorded trace file or folder: data.import_traces's, and an imported `data.source`."""

    format: str = knob(MISSING, "the source's format", one_of(_formats))
    src: str = knob(MISSING, "the trace file or folder", nonempty)
    skip_bad_lines: bool = knob(False, "true drops invalid records and lists them instead of failing")
    hidden_model: Optional[str] = knob(None, "the serving model whose hidden states the calls carry (recorded in "
                                             "meta.json as hidden.model)")
    hidden_size: Optional[int] = knob(None, "every call's hidden vector has this many values (null: as many as the "
                                            "first one); recorded in meta.json as hidden.size", at_least(1))
    n_workflows: Optional[int] = knob(None, "keep the source's first N workflows, in its own order (null: all; "
                                            "debug runs); more than the source holds is an error", at_least(1))

    def __post_init__(self):
        check(self)


@dataclass
class GeneratedSourceConfig(WorkloadDraw):
    _target_: str = "data.generators.generate"


@dataclass
class ImportedSourceConfig(TraceSource):
    _target_: str = "data.readers.read_traces"


# ------------------------------------------------------------------ the `data` node (train.py, evaluate.py)

@dataclass
class DataConfig:
    """A dataset: a directory written by data.generate / data.import_traces (`path`), or built from
    `source` on first use and cached under `cache_dir`, keyed by the recipe (source and split)."""

    name: str = knob(MISSING, "the dataset's name (run names, W&B groups, cache folders)", nonempty)
    path: Optional[str] = knob(None, "a dataset directory; replaces the source", _existing_dir)
    source: Any = knob(None, "the traces' recipe: a generated workload or an imported trace source")
    split: SplitConfig = knob(None, "train / val / test assignment", factory=SplitConfig)
    cache_dir: str = knob(DATA_CACHE, "where built datasets are cached", nonempty)

    def __post_init__(self):
        check(self)
        if isinstance(self.source, GeneratedSourceConfig) and self.path is None:
            too_few(self.source.n_workflows, self.split, "source.n_workflows")


@dataclass
class GeneratedDataConfig(DataConfig):
    source: GeneratedSourceConfig = knob(None, "the generated workload and how many workflows",
                                         factory=GeneratedSourceConfig)


@dataclass
class ImportedDataConfig(DataConfig):
    source: ImportedSourceConfig = knob(None, "the recorded traces", factory=ImportedSourceConfig)


def data_config(node, prefix: str = "data") -> DataConfig:
    """The composed `data` node as its checked config (its source's `_target_` picks the kind)."""
    generated = (node.get("source") or {}).get("_target_") == GeneratedSourceConfig._target_
    return build(node, GeneratedDataConfig if generated else ImportedDataConfig, prefix)


# ------------------------------------------------------------------ the commands

@dataclass
class DatasetOutput:
    """Where data.generate and data.import_traces save the dataset, and how they split it."""

    out: str = knob(MISSING, "the dataset directory to write", nonempty)
    overwrite: bool = knob(False, "replace `out` if an earlier data.generate / data.import_traces wrote it")
    split: SplitConfig = knob(None, "train / val / test assignment", factory=SplitConfig)


@dataclass
class GenerateConfig(DatasetOutput, WorkloadDraw):
    """python -m data.generate: draw workflows, split them, save the dataset to `out`."""

    def __post_init__(self):
        super().__post_init__()
        too_few(self.n_workflows, self.split, "n_workflows")


@dataclass
class ImportConfig(DatasetOutput, TraceSource):
    """python -m data.import_traces: read and validate a trace source, split it, save it to `out`."""

    def __post_init__(self):
        super().__post_init__()
        if not located(self.src).exists():  # a file may also be found as its compressed copy NAME.gz
            raise ConfigError(f"src={self.src}: no such file or directory")


def register_schemas() -> None:
    for cls in (HoverConfig, SweBenchConfig, FinanceBenchConfig):
        register("workload", cls, f"{cls._target_.rsplit('.', 1)[1].lower()}_schema")
    register("data", GeneratedDataConfig, "generated_schema")
    register("data", ImportedDataConfig, "imported_schema")
    register(None, GenerateConfig, "generate_schema")
    register(None, ImportConfig, "import_traces_schema")


register_schemas()
