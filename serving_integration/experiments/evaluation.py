"""evaluate.py's logic: replay one workload under each policy, collect rows, print, plot, log.

A row is one (workload, policy, prefetch, gpu_tokens, concurrency, noise) run of the simulator on
the same workflows and seed. The policies (`policies=[...]`):

    lru, lfu, tlru    SGLang's built-in orders, no predictions
    fifo, mru, filo,  SGLang's other strategies (0.5.23), no predictions (cache/baselines.py)
    slru, priority
    kvflow            KVFlow (arXiv 2507.07400) as its public code runs it (docs/baselines/kvflow.md):
                      tiered hold priorities from the Agent Step Graph of the workflow's definition
                      (the graph a generated dataset declares in meta.json; for imported traces, every
                      transition seen in the train split), in two rows: with its own prefetch
                      (prefetch=kvflow: the last nodes of agents due in steps 0-2) and with none (to
                      compare eviction orders at equal prefetch)
    kvflow_ideal      the idealised KVFlow (steps-to-execution per workflow, retired cache first), and
    kvflow_nolae      the same without the lifecycle signal; both with aggressive prefetch and none
    lru_prefetch      LRU, prefetching each waiting workflow's own last node (prefetch=last_call)
    continuum         Continuum's tool-call TTL pin (arXiv 2511.02230; docs/baselines/continuum.md)
    pbkv_lae          lifecycle-aware LRU: retired cache first
    pbkv              the hierarchical PBKV score from the predictor (predictor.checkpoint, else a
                      first-order Markov predictor fitted on the train split)
    pbkv_perfect      the same score fed the true future agents (a perfect predictor)
    pbkv_time         PBKV's score with each read discounted by when it is expected (the predictor's
                      times, pbkv.time_tau_s) and the queued calls known (cache/policies.py PBKVTime),
                      under each pbkv.trust mode as pbkv
    pbkv_time_perfect the same fed the true agents and tool times, always trusted
    oracle            clairvoyant eviction by furthest next use of the real future, prefetching
                      for the true next calls: a heuristic reference, not a bound (policies can
                      beat it); every row carries proven bounds on its own request sequence
                      (serving_integration/simulator/bound.py), and setting_bound_hit_rate, the
                      one of its setting that no row of its prefetch class exceeds (rows.py)

`prefetch=[none,conservative,aggressive]` applies to pbkv, pbkv_perfect and oracle (the paper's
full PBKV is pbkv with conservative prefetch); `predictor.noise` mixes pbkv's predictions with
random distributions.

`seeds=[0,1,2]` replays every setting once per seed s: the workload drawn with seed s (generated
data: `data.source.seed=s`; imported traces: `data.split.seed=s`; data.store.resolve_seeded), the
simulator and noise seeded with s, a predictor trained with seed s; summary.json's `rows` then hold
the mean over seeds of every metric, its 95% confidence interval (`{metric}_ci95`, Student t over
the seeds) and the per-seed values (`{metric}_per_seed`); `seed_rows` the per-seed rows. Without
`seeds`, one replay with `seed` on the data as configured. On imported traces (fixed data) each row
also keeps `per_workflow`, every replayed workflow's latency and missed prompt tokens (pooled over the
seeds, ids prefixed by the seed) for the report's paired bootstrap over workflows; on generated
workloads it is null.

The end signal reaches the cache `sim.end_signal_delay_s` after a workflow's last call (null: the
median tool time of the train split, the typical time an orchestrator takes to act on a result);
`sim.end_signal_loss` loses that share of them, leaving those workflows to
`sim.inactivity_timeout_s` (null: twice the longest tool time of the train split, so that no
workflow in the middle of a tool call is retired).

With `kv.budget=N`, IntentKV rows follow: every request pruned to N tokens by `kv.method` in each
of `kv.layouts`, beside the unpruned baseline (layout none), under `kv.policy`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from data import REPO, cpu_kernels, store
from data.atomic import built_once, write_json
from data.config import TEXT_ENCODINGS
from data.errors import ConfigError
from data.knobs import build
from data.stats import live_working_set_tokens
from serving_integration.cache.predictions import (AgentStepGraph, ModelSource, NoisySource, OnlineBackoff,
                                                   PerfectSource, vocabulary)
from serving_integration.cache.workload import workflows_from_rows
from serving_integration.experiments.config import PredictorConfig, Settings, settings
from serving_integration.experiments.presentation import OWN_PREFETCH
from serving_integration.experiments.rows import add_setting_bounds, aggregate_seeds, check_bounds, make_row
from serving_integration.simulator.config import SimConfig
from serving_integration.simulator.engine import simulate

log = logging.getLogger(__name__)

PREDICTIVE = ("pbkv", "pbkv_perfect", "pbkv_time", "pbkv_time_perfect")
LEARNED = ("pbkv", "pbkv_time")  # the rows the learned predictor drives (the others: the true future)


def trained_checkpoint(p: PredictorConfig, dataset_path: Path, seed: int, horizon: int,
                       wait: bool = True) -> Path | None:
    """`predictor.train=FAMILY`: train.py's checkpoint for this dataset, trained once and cached;
    `wait=False`: None at once when another job is training it now."""
    from models.text import MINILM_EMBEDDING

    recipe = {"family": p.train, "data": str(Path(dataset_path).resolve()), "seed": seed, "horizon": horizon}
    family_config = REPO / "conf" / "model" / f"{p.train}.yaml"
    if family_config.is_file():  # a changed default (e.g. a new input of the family) trains anew
        recipe["model_config"] = hashlib.sha256(family_config.read_bytes()).hexdigest()[:12]
    if p.train_overrides:
        recipe["overrides"] = list(p.train_overrides)
    recipe["cpu_kernels"] = cpu_kernels.fingerprint()  # a predictor trained on other kernels is another one
    recipe["minilm_embedding"] = MINILM_EMBEDDING  # and one trained on embeddings computed otherwise
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    run = Path(p.cache_dir).resolve() / f"{p.train}-{key}"
    if not (run / "predictor.pt").is_file():
        with built_once(run, wait) as held:  # a parallel sweep job that needs the same one waits, then finds it
            if not held:
                return None
            if not (run / "predictor.pt").is_file():
                train_into(run, p, recipe["data"], seed, horizon)
    return run / "predictor.pt"


def uses_learned(knobs: Settings) -> bool:
    """Whether the replays need pbkv's learned predictor (learned_source)."""
    return bool(set(LEARNED) & set(knobs.run.policies)) or knobs.sim.routing == "pbkv"


def train_ahead(knobs: Settings, datasets: list) -> None:
    """With `predictor.train`: the predictor of every seed (of `knobs.run.seeds`, whose datasets
    these are) before the first replay, leaving out those another job is training now (that seed's
    replay waits for it). Two sweep jobs of one dataset that start together (the experiments list
    `data` first) so split the trainings between them instead of taking turns on each; the
    predictors are the same ones either way."""
    p = knobs.predictor
    if not (p.train and not p.checkpoint and uses_learned(knobs)):
        return
    for seed, ds in zip(knobs.run.seeds, datasets):
        trained_checkpoint(p, ds.path, seed, knobs.pbkv.horizon, wait=False)


def train_into(run: Path, p: PredictorConfig, data: str, seed: int, horizon: int) -> None:
    """train.py on the dataset at `data` into `run`, in this process (models.training.train_here:
    the folder and checkpoint train.py would write, appearing complete or not at all)."""
    from hydra.errors import HydraException

    from models.training import train_here

    log.info("training %s on %s into %s", p.train, data, run)
    # the dataset's task texts, encoded once for every family and kept beside the predictors
    overrides = [f"model={p.train}", f"data.path={data}", f"seed={seed}", f"horizon={horizon}", "logger=csv",
                 f"encodings_dir={encodings_folder(p)}", *p.train_overrides]
    try:
        train_here(overrides, run)
    except HydraException as e:  # an override train.py's config cannot take
        raise ConfigError(f"predictor.train={p.train} predictor.train_overrides={list(p.train_overrides)}: "
                          f"{e}") from None


def encodings_folder(p: PredictorConfig) -> Path:
    """Where MiniLM embeddings of task texts are kept (models.text.keep_encodings_in)."""
    return Path(p.cache_dir).resolve() / TEXT_ENCODINGS


def learned_source(p: PredictorConfig, replay: "Replay", seed: int, horizon: int):
    """(source, info) behind `pbkv`: the checkpoint, else one train.py trains for train=FAMILY,
    else a first-order Markov predictor fitted on the train split."""
    from models import load_predictor, read_checkpoint
    from models.markov import MarkovPredictor
    from models.text import keep_encodings_in

    checkpoint = p.checkpoint
    if not checkpoint and p.train:
        checkpoint = trained_checkpoint(p, replay.dataset_path, seed, horizon)
    if checkpoint:
        # each seed's predictor encodes the seed's tasks: kept beside the trained predictors, every job
        # and step after the first reads them
        keep_encodings_in(encodings_folder(p))
        # agents it never saw map to <unk>; a clear error when too many do (a checkpoint of other data)
        predictor = load_predictor(checkpoint, agents=replay.agent_names[1:], max_unknown=p.max_unknown)
        if predictor.horizon != horizon:  # rows are labelled with pbkv.horizon (config.check_horizon)
            raise ValueError(f"{checkpoint} predicts {predictor.horizon} steps, pbkv.horizon is {horizon}")
        if hasattr(predictor, "describe_agents"):  # agents it never saw: embedded by name and system prompt
            predictor.describe_agents(replay.system_prompts)
        info = {"checkpoint": str(checkpoint), "family": predictor.family,
                "test_metrics": dict(read_checkpoint(checkpoint).get("metrics", {}))}
    else:
        sequences = replay.train_sequences
        names = vocabulary(a for seq in sequences for a in seq)
        index = {a: i for i, a in enumerate(names)}
        predictor = MarkovPredictor.from_sequences(names, horizon, [[index[a] for a in s] for s in sequences],
                                                   order=1)
        info = {"checkpoint": None, "family": "markov",
                "note": "order 1, fitted on the train split (no predictor.checkpoint given)"}
    return ModelSource(predictor, tabulate=p.tabulate), {**info, "online_backoff": p.online_backoff}


def for_run(p: PredictorConfig, source, seed: int, learned: bool):
    """A fresh wrapper per run: online backoff (it learns from the run's own workflows) around the
    learned predictor, then noise."""
    if learned and p.online_backoff:
        source = OnlineBackoff(source, p.online_beta)
    return NoisySource(source, p.noise, seed, kind=p.noise_kind)


@dataclass(frozen=True)
class Replay:
    """What one replay needs from a dataset, built once: the workflows of the replayed split, the
    train split (the predictor's and KVFlow's), the agents' names and KVFlow's step graph."""

    workload: str
    split: str
    workflows: list
    train: list
    train_sequences: list
    agent_names: list
    step_graph: AgentStepGraph
    dataset_path: Path | None
    system_prompts: dict  # agent -> its system prompt ("" where the trace has none): it comes with every call

    @classmethod
    def from_dataset(cls, ds, split: str, n_workflows: int | None, horizon: int) -> "Replay":
        workflows = workflows_from_rows(ds.rows(None if split == "all" else split))[: n_workflows or None]
        if not workflows:
            raise ValueError(f"split '{split}' of {ds.workload} has no workflows")
        train = workflows_from_rows(ds.rows("train"))
        sequences = [[c.agent for c in w.calls] for w in train]
        names = vocabulary([a for s in sequences for a in s] + [c.agent for w in workflows for c in w.calls])
        return cls(workload=ds.workload, split=split, workflows=workflows, train=train, train_sequences=sequences,
                   agent_names=names, step_graph=AgentStepGraph.for_dataset(ds.meta, sequences, horizon, names),
                   dataset_path=ds.path, system_prompts=ds.system_prompts(None))


KVFLOW = ("kvflow", "kvflow_ideal", "kvflow_nolae")


def policy_runs(knobs: Settings, replay: Replay, learned, seed: int):
    """(policy, prefetch mode, what drives its predictions, simulate() keyword arguments) for each
    requested policy and prefetch mode; `learned` is pbkv's (source, info) from learned_source."""
    pbkv, p = knobs.pbkv, knobs.predictor
    perfect = PerfectSource(replay.agent_names, pbkv.horizon)
    for name in knobs.run.policies:
        if name in KVFLOW:
            for mode in (OWN_PREFETCH[name], "none"):  # its own, and none (eviction at equal prefetch)
                yield name, mode, "step_graph", dict(policy=name, policy_options=knobs.kvflow.options(name),
                                                     prefetch=mode, predictions=replay.step_graph)
        elif name == "lru_prefetch":  # LRU and plain prefetch of each waiting workflow's last node
            yield name, OWN_PREFETCH[name], "none", dict(policy=name, prefetch=OWN_PREFETCH[name])
        elif name == "continuum":
            yield name, "none", "none", dict(policy=name, policy_options=dataclasses.asdict(knobs.continuum))
        elif name in PREDICTIVE:  # pbkv and pbkv_time, each learned or fed the true future
            learns, timed = name in LEARNED, name.startswith("pbkv_time")
            source, label = (learned[0], learned[1]["family"]) if learns else (perfect, "perfect")
            # the learned predictor runs under each requested trust mode; the perfect one is a bound
            for trust in (pbkv.trust_modes if learns else ("always",)):
                options = pbkv.time_options(trust) if timed else pbkv.trust_options(trust)
                for mode in knobs.run.prefetch:
                    yield name, mode, label, dict(policy="pbkv_time" if timed else "pbkv", policy_options=options,
                                                  prefetch=mode, gamma=pbkv.gamma, trust=trust,
                                                  predictions=for_run(p, source, seed, learned=learns))
        elif name == "oracle":  # the real future: Belady eviction, prefetch of the true next calls
            for mode in knobs.run.prefetch:
                yield name, mode, "perfect", dict(policy="oracle", prefetch=mode, gamma=pbkv.gamma,
                                                  predictions=perfect)
        else:
            yield name, "none", "none", dict(policy=name,
                                             policy_options=dataclasses.asdict(knobs.tlru) if name == "tlru" else {})


def evaluate(cfg: DictConfig, run_dir: Path, knobs: Settings | None = None) -> dict:
    """Run every requested policy (and the KV-pruning rows) on one workload, once per seed of
    `seeds` (or once with `seed`); write summary.json. The config is read here, once, into checked
    objects (experiments/config.py `settings`): what the runs need is handed down as objects."""
    knobs = knobs or settings(cfg)
    dataset = store.resolve(cfg.data)
    size = GpuSize.of(knobs.sim, dataset)  # once per run: every seed replays the same GPU size

    def replay_seed(ds, seed: int):
        replay = Replay.from_dataset(ds, knobs.run.split, knobs.sim.n_workflows, knobs.pbkv.horizon)
        sim = sim_config(cfg.sim, replay.train, seed, size.tokens)
        rows, info = evaluate_seed(replay, sim, knobs, seed, size)
        if ds.meta.get("format") == "generated":
            # a generated workload draws new workflows per seed: its interval is the seeds', and its
            # summary.json stays small; imported traces keep them for the bootstrap over workflows
            for row in rows:
                row["per_workflow"] = None
        return rows, info

    if not knobs.run.seeds:
        rows, info = replay_seed(dataset, knobs.run.seed)
        summary = {"rows": rows, **info}
    else:
        seed_rows, info = [], {}
        datasets = [store.resolve_seeded(cfg.data, seed) for seed in knobs.run.seeds]
        train_ahead(knobs, datasets)
        for seed, ds in zip(knobs.run.seeds, datasets):
            rows, info[seed] = replay_seed(ds, seed)
            seed_rows += rows
        # the rows pool the seeds' per-workflow results (keyed by seed); the seed rows do not repeat them
        summary = {"rows": aggregate_seeds(seed_rows),
                   "seed_rows": [{**r, "per_workflow": None} if r.get("per_workflow") else r for r in seed_rows],
                   "predictor": {s: i["predictor"] for s, i in info.items()},
                   "kvflow_graph": {s: i["kvflow_graph"] for s, i in info.items()},
                   "end_signal": {s: i["end_signal"] for s, i in info.items()}}
    summary["config"] = OmegaConf.to_container(cfg, resolve=True)
    summary["cpu_kernels"] = cpu_kernels.fingerprint()  # what else decides a trained predictor's floats
    write_json(run_dir / "summary.json", summary)
    return summary


@dataclass(frozen=True)
class GpuSize:
    """The GPU size of a run and what it is measured against: the dataset's live working set
    (data/stats.py live_working_set_tokens, at sim.concurrency) and its reusable share."""

    tokens: int
    working_set_tokens: float
    fraction: float | None  # sim.gpu_working_set_fraction; None: sim.gpu_tokens as given
    reusable_share: float | None

    @classmethod
    def of(cls, sim: SimConfig, dataset) -> "GpuSize":
        """sim.gpu_tokens, or sim.gpu_working_set_fraction x the dataset's live working set."""
        stats = dataset.stats()
        working_set = live_working_set_tokens(stats, sim.concurrency)
        fraction = sim.gpu_working_set_fraction
        tokens = sim.gpu_tokens if fraction is None else round(fraction * working_set)
        if tokens < max(1, sim.replicas):
            raise ConfigError(f"sim.gpu_working_set_fraction={fraction}: {tokens} GPU tokens for {sim.replicas} "
                              f"server(s) (live working set {working_set:,.0f} tokens at sim.concurrency="
                              f"{sim.concurrency})")
        return cls(tokens=tokens, working_set_tokens=working_set, fraction=fraction,
                   reusable_share=stats.get("reusable_share"))


def sim_config(sim: DictConfig, train_workflows, seed: int, gpu_tokens: int | None = None) -> SimConfig:
    """SimConfig of one replay from the `sim` group: null end-signal settings filled in from the
    train split's tool times (SimConfig itself would read null as "none"), the GPU size resolved
    (GpuSize: `gpu_tokens`, when given, replaces sim.gpu_tokens), seeded with `seed`."""
    options = OmegaConf.to_container(sim, resolve=True)
    tool_times = [c.tool_time for w in train_workflows for c in w.calls[1:] if c.tool_time > 0]
    if options["end_signal_delay_s"] is None:
        options["end_signal_delay_s"] = float(np.median(tool_times)) if tool_times else 0.0
    if options["inactivity_timeout_s"] is None:
        options["inactivity_timeout_s"] = 2 * max(tool_times) if tool_times and max(tool_times) > 0 else 60.0
    if gpu_tokens is not None:
        options["gpu_tokens"] = gpu_tokens
    return build({**options, "seed": seed}, SimConfig, "sim")


def evaluate_seed(replay: Replay, sim: SimConfig, knobs: Settings, seed: int,
                  size: GpuSize) -> tuple[list[dict], dict]:
    """The rows of one replay under every requested policy (and the KV-pruning rows)."""
    pbkv, p, kv = knobs.pbkv, knobs.predictor, knobs.kv
    setting = Setting(sim, knobs.cost_model, workload=replay.workload, horizon=pbkv.horizon, gamma=pbkv.gamma,
                      seed=seed, split=replay.split)
    routes_by_prediction = sim.routing == "pbkv"  # the pbkv router reads the same predictions as pbkv eviction
    learned = learned_source(p, replay, seed, pbkv.horizon) if uses_learned(knobs) else None
    rows = []
    for name, mode, label, kwargs in policy_runs(knobs, replay, learned, seed):
        if routes_by_prediction and kwargs.get("predictions") is None:
            kwargs, label = {**kwargs, "predictions": learned[0]}, learned[1]["family"]
        fields = {"noise": p.noise if name in PREDICTIVE else 0.0, "predictor": label,
                  "trust": kwargs.pop("trust", "none")}
        kwargs["headroom"] = knobs.run.headroom
        kwargs["headroom_integer"] = name in knobs.run.headroom_integer
        if name in PREDICTIVE:
            fields["noise_kind"] = p.noise_kind
        rows.append(setting.run(replay.workflows, name, mode, kwargs, **fields))
        if name in LEARNED:  # the predictor's own test top-1 at k=1 (train.py's, on this dataset's test split)
            rows[-1]["predictor_top1_k1"] = learned[1].get("test_metrics", {}).get("test/top1_k1")
        log.info("%s/%s/%s: hit rate %.3f", name, mode, fields["trust"], rows[-1]["hit_rate"])
    if kv.budget:
        from serving_integration.experiments.intentkv_replay import prune_workflows  # torch scoring, only needed here

        for layout in ("none", *kv.layouts):
            replayed = replay.workflows if layout == "none" else prune_workflows(
                replay.workflows, kv.method, kv.budget, layout, kv.chunk_tokens, kv.lam)
            rows.append(setting.run(replayed, kv.policy, "none", {"policy": kv.policy}, comparison="kv",
                                    layout=layout, kv_method="none" if layout == "none" else kv.method,
                                    kv_budget=None if layout == "none" else kv.budget))
    add_setting_bounds(rows)
    check_bounds(rows)  # a row above a proven bound means the proof or the code is wrong: stop here
    for row in rows:  # the dataset's own measures, beside each row (the memory plots' second axis, the regime page)
        row["live_working_set_tokens"] = size.working_set_tokens
        row["dataset_reusable_share"] = size.reusable_share
    graph = replay.step_graph
    info = {"predictor": learned[1] if learned else {},
            "kvflow_graph": {"origin": graph.origin, **graph.graph},
            "end_signal": {"delay_s": sim.end_signal_delay_s, "loss": sim.end_signal_loss,
                           "inactivity_timeout_s": sim.inactivity_timeout_s}}
    return rows, info


class Setting:
    """One workload setting (simulator sizes, cost model, the labels every row of it carries): runs a
    policy, returns its row. `workload` is the dataset's own name (its meta.json), not the config's."""

    def __init__(self, sim: SimConfig, cost, **labels):
        self.sim, self.cost = sim, cost
        self.labels = {**labels, "gpu_tokens": sim.gpu_tokens, "concurrency": sim.concurrency,
                       "replicas": sim.replicas, "routing": sim.routing, "scheduling": sim.scheduling,
                       "partial_eviction": sim.partial_eviction,
                       "cost_model": cost.name, "end_signal_loss": sim.end_signal_loss,
                       "hicache_ratio": sim.hicache_ratio, "gpu_working_set_fraction": sim.gpu_working_set_fraction}

    def run(self, workflows, policy: str, prefetch: str, kwargs: dict, **fields) -> dict:
        result = simulate(workflows, self.sim, self.cost, **kwargs)
        labels = {**self.labels, "policy": policy, "prefetch": prefetch, "workflows": len(workflows),
                  "calls": sum(len(w.calls) for w in workflows), **fields}
        return make_row(labels, result)
