"""The trace store: split by workflow, save atomically as a `datasets` dataset, load, resolve.

On disk a dataset directory holds:

    meta.json          schema version, source, tokenizer, split seed and sizes, statistics
    calls/             DatasetDict (train / val / test) of CALL_FEATURES rows, save_to_disk
    segments/          Dataset of SEGMENT_FEATURES rows, save_to_disk
    parquet/           the same tables as parquet: train, val, test, segments
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import Dataset, DatasetDict, load_from_disk
from datasets.utils import disable_progress_bars
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from data.atomic import atomic_dir, check_output, check_replaceable
from data.schema import CALL_FEATURES, SCHEMA_VERSION, SEGMENT_FEATURES, SPLITS, Traces
from data.stats import trace_stats

# the commands whose dataset folders one another may replace (with overwrite=true)
DATASET_WRITERS = ("data.generate", "data.import_traces", "data.store")

disable_progress_bars()  # tables here are small; per-table bars only clutter the commands' output


@dataclass
class TraceDataset:
    calls: DatasetDict  # "train" / "val" / "test"
    segments: Dataset
    meta: dict
    path: Path | None = None

    def segment_table(self) -> dict[str, dict]:
        return {row["id"]: row for row in self.segments}

    def rows(self, split: str | None = None) -> list[dict]:
        """Call rows of one split, or of all splits, grouped by workflow in step order."""
        names = SPLITS if split is None else (split,)
        return [row for name in names for row in self.calls[name]]

    def system_prompts(self, split: str | None = None) -> dict[str, str]:
        """Each agent's system prompt: the text of the first ``system`` segment of its first call in
        ``split`` (None: every split, train first), "" where the trace stores no text for it
        (generated workloads record only the prompt's token count)."""
        kinds = self.segments["kind"]
        rows = [i for i, kind in enumerate(kinds) if kind == "system"]
        chosen = self.segments.select(rows).select_columns(["id", "text"]).to_dict()
        system = dict(zip(chosen["id"], chosen["text"]))
        prompts: dict[str, str] = {}
        for name in SPLITS if split is None else (split,):
            calls = self.calls[name].select_columns(["agent", "prompt_ids"]).to_dict()
            for agent, prompt in zip(calls["agent"], calls["prompt_ids"]):
                if not prompts.get(agent):
                    prompts[agent] = next((system[i] for i in prompt if i in system), "")
        return prompts

    @property
    def workload(self) -> str:
        """The workload's own name: meta.json's (generated data), else the trace set's importer
        (who_and_when, tau_bench), else the one name the calls carry (chat or native logs), else
        the dataset folder's name."""
        if self.meta.get("workload"):
            return self.meta["workload"]
        if self.meta.get("format") not in (None, "chat", "native", "generated"):
            return self.meta["format"]
        names = {n for split in SPLITS for n in self.calls[split].unique("workload") if n}
        if len(names) == 1:
            return names.pop()
        return self.path.name if self.path else "unnamed"

    @property
    def n_workflows(self) -> int:
        return sum(self.meta["splits"][s]["workflows"] for s in SPLITS)


def assign_splits(workflow_ids: list[str], val: float, test: float, seed: int,
                  groups: dict[str, str] | None = None) -> dict[str, str]:
    """Seeded assignment of whole workflows to train / val / test (a workflow is never split).

    `groups` (workflow -> task template, for generated workloads with `template_holdout`): whole
    templates are assigned instead, in a seeded order, to test and val while they fit the
    requested sizes, and the rest to train, so no val or test template is seen in training."""
    if not (0 <= val < 1 and 0 <= test < 1 and val + test < 1):
        raise ValueError(f"split fractions val={val}, test={test} must be in [0, 1) and sum below 1")
    n = len(workflow_ids)
    n_val, n_test = round(n * val), round(n * test)
    if n >= 3:  # keep every requested split non-empty on small sources
        n_val, n_test = max(n_val, int(val > 0)), max(n_test, int(test > 0))
    if groups:
        members: dict[str, list[str]] = {}
        for w in workflow_ids:
            members.setdefault(groups[w], []).append(w)
        templates = list(members)
        split_of, room = {}, {"test": n_test, "val": n_val}
        for i in np.random.default_rng(seed).permutation(len(templates)):
            group = members[templates[i]]
            name = next((s for s in ("test", "val") if len(group) <= room[s]), "train")
            if name != "train":
                room[name] -= len(group)
            split_of.update(dict.fromkeys(group, name))
        return {w: split_of[w] for w in workflow_ids}
    order = np.random.default_rng(seed).permutation(n)
    names = np.array(["train"] * n, dtype=object)
    names[order[:n_val]] = "val"
    names[order[n_val:n_val + n_test]] = "test"
    return dict(zip(workflow_ids, names.tolist()))


def _table(rows: list[dict], features) -> Dataset:
    # columnar, so that an empty split still carries the schema
    return Dataset.from_dict({name: [r[name] for r in rows] for name in features}, features=features)


def build(traces: Traces, **split) -> TraceDataset:
    """Split the traces by workflow (`split`: val, test, seed; data.config.SplitConfig, their
    defaults and ranges) into a dataset."""
    from data.config import SplitConfig

    knobs = SplitConfig(**split)
    val, test, seed = knobs.val, knobs.test, knobs.seed
    if not traces.calls:
        raise ValueError("no calls to store (the source is empty)")
    workflow_ids = list(dict.fromkeys(c["workflow_id"] for c in traces.calls))
    groups = None
    if traces.meta.get("template_holdout"):  # generated workloads: split by task template
        groups = {c["workflow_id"]: json.loads(c["latent"])["template"] for c in traces.calls if c["step"] == 0}
    split_of = assign_splits(workflow_ids, val, test, seed, groups)
    parts = {s: [c for c in traces.calls if split_of[c["workflow_id"]] == s] for s in SPLITS}
    calls = DatasetDict({s: _table(rows, CALL_FEATURES) for s, rows in parts.items()})
    segments = _table(list(traces.segments.values()), SEGMENT_FEATURES)
    meta = {
        "schema_version": SCHEMA_VERSION,
        **traces.meta,
        "split": {"val": val, "test": test, "seed": seed, "by": "template" if groups else "workflow"},
        "splits": {s: {"workflows": len({c["workflow_id"] for c in rows}), "calls": len(rows)}
                   for s, rows in parts.items()},
        "skipped_lines": [str(issue) for issue in traces.skipped],
        "stats": trace_stats(traces.calls),
    }
    return TraceDataset(calls, segments, meta)


def save(ds: TraceDataset, out: str | Path, overwrite: bool = False, command: str = "data.store",
         inputs=()) -> Path:
    """Write the dataset to `out` all at once: built in a temporary sibling, then renamed (see
    data.atomic: never over one of `inputs`, nor over a folder no dataset writer made)."""
    out = Path(out)
    check_output(out, inputs)
    check_replaceable(out, DATASET_WRITERS)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=true to replace it)")
    with atomic_dir(out, command, inputs, replaces=DATASET_WRITERS) as tmp:
        ds.calls.save_to_disk(str(tmp / "calls"))
        ds.segments.save_to_disk(str(tmp / "segments"))
        (tmp / "parquet").mkdir()
        for split in SPLITS:
            ds.calls[split].to_parquet(str(tmp / "parquet" / f"{split}.parquet"))
        ds.segments.to_parquet(str(tmp / "parquet" / "segments.parquet"))
        (tmp / "meta.json").write_text(json.dumps(ds.meta, indent=2, sort_keys=True))
    ds.path = out
    return out


def load(path: str | Path) -> TraceDataset:
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a trace dataset (no meta.json); "
                                "write one with `python -m data.generate` or `python -m data.import_traces`")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_file}: corrupt meta.json ({e})") from e
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {meta.get('schema_version')}, this code reads "
                         f"{SCHEMA_VERSION}; rebuild the dataset")
    calls = DatasetDict({s: _load_table(path / "calls" / s, CALL_FEATURES) for s in SPLITS})
    return TraceDataset(calls, _load_table(path / "segments", SEGMENT_FEATURES), meta, path)


def _load_table(path: Path, features) -> Dataset:
    # datasets writes no arrow file for an empty table and cannot load it back; rebuild it empty
    if not json.loads((path / "state.json").read_text())["_data_files"]:
        return _table([], features)
    return load_from_disk(str(path))


def resolve(cfg: DictConfig) -> TraceDataset:
    """The `data` config group: `data.path` if set, else build from `data.source` and cache it."""
    if cfg.get("path"):
        return load(cfg.path)
    recipe = OmegaConf.to_container(cfg, resolve=True)
    recipe = {k: recipe[k] for k in ("source", "split")}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    cached = Path(cfg.cache_dir) / f"{cfg.name}-{key}"
    if not (cached / "meta.json").is_file():
        traces: Traces = instantiate(cfg.source, _convert_="all")
        ds = build(traces, **cfg.split)
        ds.meta["recipe"] = recipe
        save(ds, cached, overwrite=True)
    return load(cached)


def resolve_seeded(cfg: DictConfig, seed: int) -> TraceDataset:
    """The `data` config's dataset drawn with workload seed `seed` (evaluate's `seeds=[...]`):
    a generated source is generated again with `source.seed=seed`; a source without a seed (imported
    traces) is split again with `split.seed=seed`; a dataset directory (`data.path`) is rebuilt from
    the recipe its meta.json records when that has a seed, else split again with that seed (cached
    beside the generated datasets)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if cfg.get("path"):
        ds = load(cfg.path)
        recipe = ds.meta.get("recipe") or {}
        if "seed" in recipe.get("source", {}):
            cfg.path = None
            cfg.source, cfg.split = recipe["source"], recipe["split"]
            cfg.source.seed = seed
            return resolve(cfg)
        if ds.meta["split"]["seed"] == seed:
            return ds
        key = hashlib.sha256(json.dumps([str(Path(cfg.path).resolve()), seed]).encode()).hexdigest()[:12]
        cached = Path(cfg.cache_dir) / f"{cfg.name}-resplit-{key}"
        if not (cached / "meta.json").is_file():
            from data.schema import SegmentTable

            meta = {k: v for k, v in ds.meta.items() if k not in ("schema_version", "split", "splits", "stats",
                                                                    "skipped_lines")}
            traces = Traces(ds.rows(None), SegmentTable(ds.segment_table()), {**meta, "resplit_of": str(cfg.path)})
            split = {k: ds.meta["split"][k] for k in ("val", "test")}
            save(build(traces, **split, seed=seed), cached, overwrite=True)
        return load(cached)
    if "seed" in cfg.source:
        cfg.source.seed = seed
    else:
        cfg.split.seed = seed
    return resolve(cfg)
