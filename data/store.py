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
from typing import Callable

import numpy as np
import pyarrow.compute
from datasets import Dataset, DatasetDict, load_from_disk
from datasets.utils import disable_progress_bars
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from data.atomic import atomic_dir, built_once, check_output, check_replaceable
from data.schema import CALL_FEATURES, SCHEMA_VERSION, SEGMENT_FEATURES, SPLITS, Traces
from data.stats import largest_prompt_per_workflow, summary, trace_stats

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
        return {row["id"]: row for row in self.segments.to_list()}

    def rows(self, split: str | None = None) -> list[dict]:
        """Call rows of one split, or of all splits, grouped by workflow in step order."""
        names = SPLITS if split is None else (split,)
        # to_list converts each table at once (Arrow's to_pylist): the same rows as iterating the
        # Dataset, which formats one row at a time, 5 to 20 times faster
        return [row for name in names for row in self.calls[name].to_list()]

    def system_prompts(self, split: str | None = None) -> dict[str, str]:
        """Each agent's system prompt: the text of the first ``system`` segment of its first call in
        ``split`` (None: every split, train first), "" where the trace stores no text for it
        (generated workloads record only the prompt's token count)."""
        # read as Arrow tables (a tenth of the time of formatting each column to Python first)
        segments = self.segments.select_columns(["id", "kind", "text"]).with_format("arrow")[:]
        chosen = segments.filter(pyarrow.compute.equal(segments["kind"], "system")).to_pydict()
        system = dict(zip(chosen["id"], chosen["text"]))
        prompts: dict[str, str] = {}
        for name in SPLITS if split is None else (split,):
            calls = self.calls[name].select_columns(["agent", "prompt_ids"]).with_format("arrow")[:].to_pydict()
            for agent, prompt in zip(calls["agent"], calls["prompt_ids"]):
                if not prompts.get(agent):
                    prompts[agent] = next((system[i] for i in prompt if i in system), "")
        return prompts

    def stats(self) -> dict:
        """meta.json's `stats` (data/stats.py trace_stats); a statistic added after the dataset was
        written (the largest prompt of a workflow) is computed from its calls, the folder unchanged."""
        stats = dict(self.meta.get("stats", {}))
        if "largest_prompt_tokens_per_workflow" not in stats:
            columns = [self.calls[name].select_columns(["workflow_id", "prompt_tokens"]).to_dict() for name in SPLITS]
            calls = [{"workflow_id": w, "prompt_tokens": n} for c in columns
                     for w, n in zip(c["workflow_id"], c["prompt_tokens"])]
            stats["largest_prompt_tokens_per_workflow"] = summary(largest_prompt_per_workflow(calls))
        return stats

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
    """A stored dataset, checked before use: meta.json, each table's columns, token counts >= 0 and
    each workflow's steps in increasing order. Anything else is one line naming the file."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a trace dataset (no meta.json); "
                                "write one with `python -m data.generate` or `python -m data.import_traces`")
    meta = _read_meta(meta_file)
    calls = DatasetDict({s: _load_table(path / "calls" / s, CALL_FEATURES) for s in SPLITS})
    segments = _load_table(path / "segments", SEGMENT_FEATURES)
    for split in SPLITS:
        _check_calls(calls[split], path / "calls" / split)
    _check_nonnegative(segments, "tokens", path / "segments")
    return TraceDataset(calls, segments, meta, path)


REBUILD = "rebuild the dataset (python -m data.generate or data.import_traces)"


def _read_meta(meta_file: Path) -> dict:
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_file}: corrupt meta.json ({e}); {REBUILD}") from None
    except RecursionError:
        raise ValueError(f"{meta_file}: JSON nested too deeply; {REBUILD}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file}: expected a JSON object, got {type(meta).__name__}; {REBUILD}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{meta_file}: schema version {meta.get('schema_version')}, this code reads "
                         f"{SCHEMA_VERSION}; {REBUILD}")
    split, splits = meta.get("split"), meta.get("splits")
    if not isinstance(split, dict) or not all(isinstance(split.get(k), (int, float)) and not isinstance(split.get(k), bool)
                                              for k in ("val", "test", "seed")):
        raise ValueError(f"{meta_file}: field 'split': expected val, test and seed numbers; {REBUILD}")
    for name in SPLITS:
        sizes = splits.get(name) if isinstance(splits, dict) else None
        if not isinstance(sizes, dict) or any(isinstance(sizes.get(k), bool) or not isinstance(sizes.get(k), int)
                                              or sizes[k] < 0 for k in ("workflows", "calls")):
            raise ValueError(f"{meta_file}: field 'splits.{name}': expected non-negative workflows and calls "
                             f"counts; {REBUILD}")
    checked_recipe(meta, str(meta_file))
    return meta


def _table_file(table: Dataset, folder: Path) -> str:
    files = getattr(table, "cache_files", None) or []
    return files[0]["filename"] if files else str(folder)


def _check_nonnegative(table: Dataset, column: str, folder: Path) -> None:
    import pyarrow.compute as pc

    values = table.data.column(column)
    if _is_list(values.type):
        values = pc.list_flatten(values)
    smallest = pc.min(values).as_py() if len(values) else None
    if smallest is not None and smallest < 0:
        row = next(i for i, v in enumerate(table[column]) if (min(v, default=0) if isinstance(v, list) else v) < 0)
        raise ValueError(f"{_table_file(table, folder)}: field '{column}': {smallest} in row {row}; token counts "
                         f"are >= 0 (a corrupt or crafted dataset: {REBUILD})")


def _is_list(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _check_calls(table: Dataset, folder: Path) -> None:
    for column in ("prompt_segment_tokens", "prompt_tokens", "output_tokens"):
        _check_nonnegative(table, column, folder)
    if not len(table):
        return
    workflows = np.asarray(table.data.column("workflow_id").to_pylist(), dtype=object)
    steps = table.data.column("step").to_numpy(zero_copy_only=False)
    out_of_order = np.flatnonzero((workflows[1:] == workflows[:-1]) & (steps[1:] <= steps[:-1]))
    if len(out_of_order):
        row = int(out_of_order[0]) + 1
        raise ValueError(f"{_table_file(table, folder)}: field 'step': workflow {workflows[row]} has step "
                         f"{steps[row]} after {steps[row - 1]} (row {row}); steps must increase ({REBUILD})")


def _load_table(path: Path, features) -> Dataset:
    # datasets writes no arrow file for an empty table and cannot load it back; rebuild it empty
    try:
        state = json.loads((path / "state.json").read_text())
        table = _table([], features) if not state["_data_files"] else load_from_disk(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a readable table ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}); {REBUILD}") from None
    if not isinstance(table, Dataset):
        raise ValueError(f"{path}: not a table; {REBUILD}")
    missing = [name for name in features if name not in table.features]
    if missing:
        raise ValueError(f"{_table_file(table, path)}: missing column(s) {', '.join(missing)}; {REBUILD}")
    wrong = next((n for n in features if table.features[n] != features[n]), None)
    if wrong is not None:
        raise ValueError(f"{_table_file(table, path)}: column '{wrong}' has type {table.features[wrong]}, "
                         f"expected {features[wrong]}; {REBUILD}")
    return table


GENERATE_TARGET = "data.generators.generate"  # the `data` configs' source targets (conf/data/*.yaml)
IMPORT_TARGET = "data.readers.read_traces"
RECIPE_KEYS = {"generated": {"workload", "parameters", "n_workflows", "seed", "split"},
               "imported": {"format", "src", "skip_bad_lines", "hidden_model", "hidden_size", "n_workflows", "split"}}


def plain_recipe(source: dict, split: dict) -> dict:
    """What meta.json records of the `data` config that built a dataset: plain values, a workload
    named by its registry name (data.generators.WORKLOADS) and its parameters, never a callable."""
    from data.generators import WORKLOADS

    source = dict(source)
    target = source.pop("_target_", None)
    if target == GENERATE_TARGET:
        parameters = dict(source.pop("workload"))
        workload_target = parameters.pop("_target_", None)
        names = {f"data.generators.{cls.__name__}": name for name, cls in WORKLOADS.items()}
        if workload_target not in names:
            raise ValueError(f"data.source.workload._target_={workload_target}: not a workload of "
                             f"data.generators.WORKLOADS ({', '.join(names)})")
        return {"kind": "generated", "workload": names[workload_target], "parameters": parameters,
                "n_workflows": source.get("n_workflows"), "seed": source.get("seed", 0), "split": dict(split)}
    if target == IMPORT_TARGET:
        return {"kind": "imported", **source, "split": dict(split)}
    raise ValueError(f"data.source._target_={target}: a dataset is built by {GENERATE_TARGET} or {IMPORT_TARGET}")


def checked_recipe(meta: dict, where: str) -> dict | None:
    """meta.json's recipe as plain values (None when it records none), checked against the named
    workload's parameters; a recipe written before recipes were plain values (``source`` with
    Hydra targets) is read when its targets are exactly the registry's, else refused."""
    from data.generators import WORKLOADS

    recipe = meta.get("recipe")
    if recipe is None:
        return None
    regenerate = "regenerate the dataset (python -m data.generate or data.import_traces)"
    if not isinstance(recipe, dict):
        raise ValueError(f"{where}: field 'recipe': expected an object; {regenerate}")
    if "source" in recipe and "kind" not in recipe:  # the earlier layout: Hydra's config, targets included
        try:
            recipe = plain_recipe(recipe["source"], recipe.get("split") or {})
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{where}: field 'recipe': {e}; {regenerate}") from None
    kind = recipe.get("kind")
    if kind not in RECIPE_KEYS:
        raise ValueError(f"{where}: field 'recipe.kind': {kind!r} is not one of {', '.join(RECIPE_KEYS)}; {regenerate}")
    unknown = set(recipe) - RECIPE_KEYS[kind] - {"kind"}
    if unknown:
        raise ValueError(f"{where}: field 'recipe': unknown key(s) {', '.join(sorted(unknown))}; {regenerate}")
    plain_values(recipe, f"{where}: field 'recipe'")
    if kind == "generated":
        name = recipe.get("workload")
        if name not in WORKLOADS:
            raise ValueError(f"{where}: field 'recipe.workload': {name!r} is not one of {', '.join(WORKLOADS)}")
        check_parameters(WORKLOADS[name], recipe.get("parameters") or {}, f"{where}: field 'recipe.parameters'")
        for key in ("n_workflows", "seed"):
            value = recipe.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "n_workflows" else 0):
                raise ValueError(f"{where}: field 'recipe.{key}': {value!r} is not a "
                                 f"{'positive' if key == 'n_workflows' else 'non-negative'} integer")
    return recipe


def plain_values(value, where: str, depth: int = 0) -> None:
    """Refuse anything but JSON values, and any Hydra key (``_target_`` and its kin) at any depth."""
    if depth > 32:
        raise ValueError(f"{where}: nested deeper than 32 levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or (key.startswith("_") and key.endswith("_")):
                raise ValueError(f"{where}: key {key!r} is not allowed (values only, no callables)")
            plain_values(item, where, depth + 1)
    elif isinstance(value, list):
        for item in value:
            plain_values(item, where, depth + 1)
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise ValueError(f"{where}: {type(value).__name__} is not a plain value")


def check_parameters(cls, parameters: dict, where: str) -> None:
    """`parameters` name only knobs of the workload (its dataclass in data/config.py)."""
    import dataclasses

    from data.config import WORKLOAD_CONFIGS

    knobs = WORKLOAD_CONFIGS[f"{cls.__module__}.{cls.__name__}"]
    allowed = [f.name for f in dataclasses.fields(knobs) if not f.name.startswith("_")]
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}: expected an object of {cls.name}'s parameters")
    unknown = sorted(set(parameters) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} is not a parameter of {cls.name} ({', '.join(allowed)})")


def recreate(recipe: dict, seed: int, cache_dir: str | Path, name: str) -> TraceDataset:
    """The generated dataset `recipe` describes, drawn with workload seed `seed` (cached): the
    workload is built from the registry with its checked parameters, never through `instantiate`."""
    from data.generators import WORKLOADS, generate

    recipe = {**recipe, "seed": seed}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]

    def make() -> TraceDataset:
        try:
            workload = WORKLOADS[recipe["workload"]](**recipe["parameters"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"recipe of {name}: workload {recipe['workload']} does not build: {e}") from None
        ds = build(generate(workload, recipe["n_workflows"], seed), **recipe["split"])
        ds.meta["recipe"] = recipe
        return ds

    return cached_build(Path(cache_dir) / f"{name}-{key}", make)


def cached_build(cached: Path, make: Callable[[], TraceDataset]) -> TraceDataset:
    """The dataset cached in `cached`, made by `make` and saved there first when missing (one
    sweep job makes it while the others that need it wait: data.atomic.built_once)."""
    if not (cached / "meta.json").is_file():
        with built_once(cached):
            if not (cached / "meta.json").is_file():
                save(make(), cached, overwrite=True)
    return load(cached)


def resolve(cfg: DictConfig) -> TraceDataset:
    """The `data` config group: `data.path` if set, else build from `data.source` and cache it."""
    if cfg.get("path"):
        return load(cfg.path)
    recipe = OmegaConf.to_container(cfg, resolve=True)
    recipe = {k: recipe[k] for k in ("source", "split")}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]

    def make() -> TraceDataset:
        traces: Traces = instantiate(cfg.source, _convert_="all")  # the config's own source, not a file's
        ds = build(traces, **cfg.split)
        ds.meta["recipe"] = plain_recipe(recipe["source"], recipe["split"])
        return ds

    return cached_build(Path(cfg.cache_dir) / f"{cfg.name}-{key}", make)


def resolve_seeded(cfg: DictConfig, seed: int) -> TraceDataset:
    """The `data` config's dataset drawn with workload seed `seed` (evaluate's `seeds=[...]`):
    a generated source is generated again with `source.seed=seed`; a source without a seed (imported
    traces) is split again with `split.seed=seed`; a dataset directory (`data.path`) is rebuilt from
    the recipe its meta.json records when that is a generated one (plain values: see
    `checked_recipe`), else split again with that seed (cached beside the generated datasets)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if cfg.get("path"):
        ds = load(cfg.path)
        recipe = checked_recipe(ds.meta, str(Path(cfg.path) / "meta.json"))
        if recipe is not None and recipe["kind"] == "generated":
            return recreate(recipe, seed, cfg.cache_dir, cfg.name)
        if ds.meta["split"]["seed"] == seed:
            return ds
        key = hashlib.sha256(json.dumps([str(Path(cfg.path).resolve()), seed]).encode()).hexdigest()[:12]

        def make() -> TraceDataset:
            from data.schema import SegmentTable

            meta = {k: v for k, v in ds.meta.items() if k not in ("schema_version", "split", "splits", "stats",
                                                                    "skipped_lines", "recipe")}
            traces = Traces(ds.rows(None), SegmentTable(ds.segment_table()), {**meta, "resplit_of": str(cfg.path)})
            split = {k: ds.meta["split"][k] for k in ("val", "test")}
            return build(traces, **split, seed=seed)

        return cached_build(Path(cfg.cache_dir) / f"{cfg.name}-resplit-{key}", make)
    if "seed" in cfg.source:
        cfg.source.seed = seed
    else:
        cfg.split.seed = seed
    return resolve(cfg)
