"""evaluate.py's logic: replay one workload under each policy, collect rows, print, plot, log.

A row is one (workload, policy, prefetch, gpu_tokens, concurrency, noise) run of the simulator on
the same workflows and seed. The policies (`policies=[...]`):

    lru, lfu, tlru    SGLang's built-in orders, no predictions
    kvflow            KVFlow (arXiv 2507.07400): its steps-to-execution order from the Agent Step
                      Graph of the workflow's definition (the graph a generated dataset declares in
                      meta.json; for imported traces, every transition seen in the train split), in
                      two rows: with its own (aggressive) prefetch for the next agents, and with none
                      (to compare eviction orders at equal prefetch)
    pbkv_lae          lifecycle-aware LRU: retired cache first
    pbkv              the hierarchical PBKV score from the predictor (predictor.checkpoint, else a
                      first-order Markov predictor fitted on the train split)
    pbkv_perfect      the same score fed the true future agents (a perfect predictor)
    oracle            clairvoyant eviction by furthest next use of the real future, prefetching
                      for the true next calls: a heuristic reference, not a bound (policies can
                      beat it); every row's bound_hit_rate is a proven upper bound on its own
                      request sequence (serving_integration/simulator/bound.py)

`prefetch=[none,conservative,aggressive]` applies to pbkv, pbkv_perfect and oracle (the paper's
full PBKV is pbkv with conservative prefetch); `predictor.noise` mixes pbkv's predictions with
random distributions.

`seeds=[0,1,2]` replays every setting once per seed s: the workload drawn with seed s (generated
data: `data.source.seed=s`; imported traces: `data.split.seed=s`; data.store.resolve_seeded), the
simulator and noise seeded with s, a predictor trained with seed s; summary.json's `rows` then hold
the mean over seeds of every metric, its 95% confidence interval (`{metric}_ci95`, Student t over
the seeds) and the per-seed values (`{metric}_per_seed`); `seed_rows` the per-seed rows. Without
`seeds`, one replay with `seed` on the data as configured.

The end signal reaches the cache `sim.end_signal_delay_s` after a workflow's last call (null: the
median tool time of the train split, the typical time an orchestrator takes to act on a result);
`sim.end_signal_loss` loses that share of them, leaving those workflows to
`sim.inactivity_timeout_s` (null: twice the longest tool time of the train split, so that no
workflow in the middle of a tool call is retired).

With `kv.budget=N`, IntentKV rows follow: every request pruned to N tokens by `kv.method` in each
of `kv.layouts`, beside the unpruned baseline (layout none), under `kv.policy`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from data import store
from data.atomic import temporary_sibling_dir, write_json
from serving_integration.cache.policies import POLICIES as EVICTION_POLICIES
from serving_integration.cache.predictions import (AgentStepGraph, ModelSource, NoisySource, OnlineBackoff,
                                                   PerfectSource, vocabulary)
from serving_integration.cache.workload import workflows_from_rows
from serving_integration.experiments.presentation import add_gap_closed, aggregate_seeds, make_row
from serving_integration.simulator.engine import SimConfig, simulate

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]  # the repository root (train.py)

PREDICTIVE = ("pbkv", "pbkv_perfect")
# every eviction policy, plus pbkv_perfect: the pbkv class fed the true future agents
POLICIES = (*EVICTION_POLICIES, "pbkv_perfect")


def trained_checkpoint(cfg: DictConfig, dataset_path: Path) -> Path:
    """`predictor.train=FAMILY`: train.py's checkpoint for this dataset, trained once and cached."""
    recipe = {"family": cfg.predictor.train, "data": str(Path(dataset_path).resolve()), "seed": cfg.seed,
              "horizon": cfg.pbkv.horizon}
    overrides = list(cfg.predictor.get("train_overrides") or [])
    if overrides:
        recipe["overrides"] = overrides
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    run = Path(cfg.predictor.cache_dir).resolve() / f"{cfg.predictor.train}-{key}"
    if not (run / "predictor.pt").is_file():
        # trained in a temporary sibling and renamed: parallel sweep jobs may train the same one
        tmp = temporary_sibling_dir(run)
        log.info("training %s on %s into %s", cfg.predictor.train, dataset_path, run)
        try:
            subprocess.run([sys.executable, str(REPO / "train.py"), f"model={cfg.predictor.train}",
                            f"data.path={recipe['data']}", f"seed={cfg.seed}", f"horizon={cfg.pbkv.horizon}",
                            "logger=csv", f"hydra.run.dir={tmp}", *overrides], cwd=REPO, check=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, subprocess.CalledProcessError):
                raise ValueError(f"predictor.train={cfg.predictor.train}: train.py failed with exit status "
                                 f"{e.returncode} (its output is above)") from None
            raise
        try:
            tmp.rename(run)
        except OSError:  # another job got there first; its checkpoint is the same recipe's
            shutil.rmtree(tmp, ignore_errors=True)
    return run / "predictor.pt"


def learned_source(cfg: DictConfig, train_sequences: list[list[str]], agents: list[str],
                   dataset_path: Path | None = None):
    """The predictor behind `pbkv`: predictor.checkpoint, else one train.py trains for
    predictor.train=FAMILY, else a first-order Markov predictor fitted on the train split."""
    from models import load_predictor
    from models.markov import MarkovPredictor

    checkpoint = cfg.predictor.checkpoint
    if not checkpoint and cfg.predictor.train:
        checkpoint = trained_checkpoint(cfg, dataset_path)
    if checkpoint:
        # agents it never saw map to <unk>; a clear error when too many do (a checkpoint of other data)
        predictor = load_predictor(checkpoint, agents=agents, max_unknown=cfg.predictor.max_unknown)
        return ModelSource(predictor), {"checkpoint": str(checkpoint), "family": predictor.family,
                                        "test_metrics": checkpoint_metrics(checkpoint)}
    names = vocabulary(a for seq in train_sequences for a in seq)
    index = {a: i for i, a in enumerate(names)}
    predictor = MarkovPredictor.from_sequences(names, cfg.pbkv.horizon, [[index[a] for a in s] for s in train_sequences],
                                               order=1)
    return ModelSource(predictor), {"checkpoint": None, "family": "markov",
                                    "note": "order 1, fitted on the train split (no predictor.checkpoint given)"}


def checkpoint_metrics(path: str) -> dict:
    from models import read_checkpoint

    return dict(read_checkpoint(path).get("metrics", {}))


KVFLOW_PREFETCH = ("aggressive", "none")  # its own, and none (eviction compared at equal prefetch)
TRUST_OPTIONS = ("trust_threshold", "trust_margin", "trust_window")


def trust_modes(cfg: DictConfig) -> list[str]:
    """pbkv.trust: one mode or a list of them (evaluate compares adaptive with always)."""
    modes = cfg.pbkv.trust
    return [modes] if isinstance(modes, str) else list(modes)


def online(cfg: DictConfig, source):
    """predictor.online: a fresh OnlineBackoff per run (it learns from the run's own workflows)."""
    return OnlineBackoff(source, cfg.predictor.online_beta) if cfg.predictor.get("online", False) else source


def noisy_source(cfg: DictConfig, source):
    return NoisySource(source, cfg.predictor.noise, cfg.seed, kind=cfg.predictor.get("noise_kind", "uniform"))


def policy_runs(cfg: DictConfig, train_sequences, agent_names, learned, step_graph=None):
    """(policy, prefetch mode, what drives its predictions, simulate() keyword arguments) for each
    requested policy and prefetch mode; `learned` is pbkv's (source, info) from learned_source,
    `step_graph` kvflow's AgentStepGraph."""
    unknown = sorted(set(cfg.policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    for name in cfg.policies:
        if name == "kvflow":
            graph = step_graph or AgentStepGraph.from_traces(train_sequences, cfg.pbkv.horizon)
            for mode in KVFLOW_PREFETCH:
                yield name, mode, "step_graph", dict(policy="kvflow", policy_options=dict(cfg.kvflow), prefetch=mode,
                                                     predictions=graph)
        elif name in PREDICTIVE:
            source, label = ((learned[0], learned[1]["family"]) if name == "pbkv"
                             else (PerfectSource(agent_names, cfg.pbkv.horizon), "perfect"))
            # the learned predictor runs under each requested trust mode; the perfect one is a bound
            for trust in (trust_modes(cfg) if name == "pbkv" else ["always"]):
                options = {"trust": trust, **{k: cfg.pbkv[k] for k in TRUST_OPTIONS}}
                for mode in cfg.prefetch:
                    noisy = noisy_source(cfg, online(cfg, source) if name == "pbkv" else source)
                    yield name, mode, label, dict(policy="pbkv", policy_options=options, prefetch=mode,
                                                  predictions=noisy, gamma=cfg.pbkv.gamma, trust=trust)
        elif name == "oracle":  # the real future: Belady eviction, prefetch of the true next calls
            for mode in cfg.prefetch:
                yield name, mode, "perfect", dict(policy="oracle", prefetch=mode, gamma=cfg.pbkv.gamma,
                                                  predictions=PerfectSource(agent_names, cfg.pbkv.horizon))
        else:
            options = dict(cfg.tlru) if name == "tlru" else {}
            yield name, "none", "none", dict(policy=name, policy_options=options)


def evaluate(cfg: DictConfig, run_dir: Path) -> dict:
    """Run every requested policy (and the KV-pruning rows) on one workload, once per seed of
    `seeds` (or once with `seed`); write summary.json."""
    seeds = list(cfg.get("seeds") or [])
    if not seeds:
        rows, info = evaluate_seed(cfg, store.resolve(cfg.data))
        summary = {"rows": rows, **info}
    else:
        seed_rows, info = [], {}
        for seed in seeds:
            seeded = cfg.copy()
            seeded.seed = seed
            rows, info[seed] = evaluate_seed(seeded, store.resolve_seeded(cfg.data, seed))
            seed_rows += rows
        summary = {"rows": aggregate_seeds(seed_rows), "seed_rows": seed_rows,
                   "predictor": {s: i["predictor"] for s, i in info.items()},
                   "kvflow_graph": {s: i["kvflow_graph"] for s, i in info.items()},
                   "end_signal": {s: i["end_signal"] for s, i in info.items()}}
    summary["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_json(run_dir / "summary.json", summary)
    return summary


def sim_config(cfg: DictConfig, train_workflows) -> SimConfig:
    """SimConfig from cfg.sim; null end-signal settings come from the train split's tool times."""
    options = {k: v for k, v in OmegaConf.to_container(cfg.sim, resolve=True).items() if k != "n_workflows"}
    tool_times = [c.tool_time for w in train_workflows for c in w.calls[1:] if c.tool_time > 0]
    if options.get("end_signal_delay_s") is None:
        options["end_signal_delay_s"] = float(np.median(tool_times)) if tool_times else 0.0
    if options.get("inactivity_timeout_s") is None:
        options["inactivity_timeout_s"] = 2 * max(tool_times) if tool_times and max(tool_times) > 0 else 60.0
    return SimConfig(**options, seed=cfg.seed)


def evaluate_seed(cfg: DictConfig, ds) -> tuple[list[dict], dict]:
    """The rows of one replay of the configured split of dataset `ds`, with seed cfg.seed."""
    workflows = workflows_from_rows(ds.rows(None if cfg.split == "all" else cfg.split))[: cfg.sim.n_workflows or None]
    if not workflows:
        raise ValueError(f"split '{cfg.split}' of {ds.workload} has no workflows")
    train = workflows_from_rows(ds.rows("train"))
    train_sequences = [[c.agent for c in w.calls] for w in train]
    agent_names = vocabulary([a for s in train_sequences for a in s] + [c.agent for w in workflows for c in w.calls])
    setting = Setting(sim_config(cfg, train), instantiate(cfg.cost_model), workload=ds.workload,
                      horizon=cfg.pbkv.horizon, gamma=cfg.pbkv.gamma, seed=cfg.seed, split=cfg.split)
    routes_by_prediction = cfg.sim.routing == "pbkv"  # the pbkv router reads the same predictions as pbkv eviction
    learned = (learned_source(cfg, train_sequences, agent_names[1:], ds.path)
               if "pbkv" in cfg.policies or routes_by_prediction else None)
    graph = AgentStepGraph.for_dataset(ds.meta, train_sequences, cfg.pbkv.horizon, agent_names)
    rows = []
    if learned:
        learned[1]["online_backoff"] = bool(cfg.predictor.get("online", False))
    for name, mode, label, kwargs in policy_runs(cfg, train_sequences, agent_names, learned, graph):
        if routes_by_prediction and kwargs.get("predictions") is None:
            kwargs, label = {**kwargs, "predictions": learned[0]}, learned[1]["family"]
        noise = cfg.predictor.noise if name in PREDICTIVE else 0.0
        fields = {"noise": noise, "predictor": label, "trust": kwargs.pop("trust", "none")}
        if name in PREDICTIVE:
            fields["noise_kind"] = cfg.predictor.get("noise_kind", "uniform")
        rows.append(setting.run(workflows, name, mode, kwargs, **fields))
        log.info("%s/%s/%s: hit rate %.3f", name, mode, fields["trust"], rows[-1]["hit_rate"])
    if cfg.kv.budget:
        from models.intentkv.replay import prune_workflows  # torch scoring, only needed here

        for layout in ("none", *cfg.kv.layouts):
            replayed = workflows if layout == "none" else prune_workflows(
                workflows, cfg.kv.method, cfg.kv.budget, layout, cfg.kv.chunk_tokens, cfg.kv.lam)
            rows.append(setting.run(replayed, cfg.kv.policy, "none", {"policy": cfg.kv.policy}, comparison="kv",
                                    layout=layout, kv_method="none" if layout == "none" else cfg.kv.method,
                                    kv_budget=None if layout == "none" else cfg.kv.budget))
    add_gap_closed(rows)
    info = {"predictor": learned[1] if learned else {},
            "kvflow_graph": {"origin": graph.origin, **graph.graph},
            "end_signal": {"delay_s": setting.sim.end_signal_delay_s, "loss": setting.sim.end_signal_loss,
                           "inactivity_timeout_s": setting.sim.inactivity_timeout_s}}
    return rows, info


class Setting:
    """One workload setting (simulator sizes, cost model, the labels every row of it carries): runs a
    policy, returns its row. `workload` is the dataset's own name (its meta.json), not the config's."""

    def __init__(self, sim: SimConfig, cost, **labels):
        self.sim, self.cost = sim, cost
        self.labels = {**labels, "gpu_tokens": sim.gpu_tokens, "concurrency": sim.concurrency,
                       "replicas": sim.replicas, "routing": sim.routing,
                       "cost_model": cost.name, "end_signal_loss": sim.end_signal_loss}

    def run(self, workflows, policy: str, prefetch: str, kwargs: dict, **fields) -> dict:
        result = simulate(workflows, self.sim, self.cost, **kwargs)
        labels = {**self.labels, "policy": policy, "prefetch": prefetch, "workflows": len(workflows),
                  "calls": sum(len(w.calls) for w in workflows), **fields}
        return make_row(labels, result)
