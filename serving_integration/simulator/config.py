"""The simulator's knobs: the simulated server and cluster (`SimConfig`, conf/sim; its routers'
options are cache/config.py's `RouterConfig`, shared with the client-side router), each default,
type, range and help line written once, here. The cost
model's fields live with it (cost_model.py `CostModel`, conf/cost_model).

Importing this module registers `sim/schema` and `cost_model/schema` with Hydra's ConfigStore, so an
unknown key or a wrong type in conf/sim or conf/cost_model fails when Hydra composes the config
(docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from data.errors import ConfigError
from data.knobs import above, at_least, build, check, knob, one_of, probability, register
from serving_integration.cache.config import RouterConfig
from serving_integration.simulator.cost_model import CostModel


SCHEDULING = ("fcfs", "program_fcfs", "lpm", "hrrn", "spf")


def _routers():
    from serving_integration.cache.router import ROUTERS

    return ROUTERS


@dataclass(frozen=True)
class SimConfig:
    """conf/sim: one SGLang server with HiCache, or `replicas` of them behind a router."""

    gpu_tokens: int = knob(300_000, "GPU KV capacity in tokens, the cluster's total with replicas (Qwen3-14B on "
                           "an 80 GB H100 holds about 240k)", above(0))
    gpu_working_set_fraction: Optional[float] = knob(
        None, "GPU KV capacity as a fraction of the dataset's live working set (concurrency x the mean largest "
        "prompt of a workflow, data/stats.py); evaluate.py resolves it to gpu_tokens before the replay "
        "(null: gpu_tokens as given; set one of the two)", above(0))
    hicache_ratio: float = knob(2.0, "host KV capacity = ratio x gpu_tokens (SGLang's --hicache-ratio)", at_least(0))
    page_size: int = knob(1, "KV page size in tokens", at_least(1))
    concurrency: int = knob(32, "live workflows (closed loop), over the whole cluster", at_least(1))
    max_prefill_tokens: int = knob(8192, "chunked prefill budget per iteration", at_least(1))
    max_running_requests: int = knob(256, "requests a server runs at once", at_least(1))
    predictor_cost_s: float = knob(0.0, "seconds charged to the timeline per batched predictor call", at_least(0))
    charge_measured_predictor_time: bool = knob(False, "charge the measured wall time instead (not reproducible)")
    n_workflows: Optional[int] = knob(None, "evaluate.py replays at most this many workflows of the split "
                                      "(null: all)", at_least(1))
    replicas: int = knob(1, "servers behind the router; gpu_tokens is split evenly among them", at_least(1))
    scheduling: str = knob("fcfs", "admission order: fcfs (SGLang's default: by call arrival), program_fcfs "
                           "(Continuum's: by the program's, i.e. the workflow's, start), lpm (SGLang's "
                           "--schedule-policy lpm: the longest cached prefix first), hrrn (SGLang's: the most "
                           "prefill tokens served while waiting per uncached token first), spf (SGLang's "
                           "shortest-prefill-first: the fewest tokens to prefill first, a chunked prefill "
                           "capped for shorter ones)", one_of(SCHEDULING))
    partial_eviction: bool = knob(False, "evict only the tail of a victim node, the fewest whole prompt units "
                                  "that free the tokens still needed (the rest stays, in the victim's place "
                                  "in the order), not the whole node as SGLang 0.5.23 does (the plugin's "
                                  "partial_eviction does it in SGLang, by pages)")
    routing: str = knob("none", "the router's policy: none (one server), round_robin, cache_aware, sticky, pbkv",
                        one_of(lambda: _routers()))
    router: RouterConfig = knob(None, "each routing policy's options", factory=RouterConfig)
    end_signal_delay_s: Optional[float] = knob(
        None, "the end signal reaches the cache this long after a workflow's last call (0: with it; null: the "
        "median tool time of the train split, which evaluate.py fills in; 0 where there is none)", at_least(0))
    end_signal_loss: float = knob(0.0, "share of end signals lost (seeded): those workflows wait for the timeout",
                                  probability)
    inactivity_timeout_s: Optional[float] = knob(
        None, "retire a workflow silent this long (null: twice the train split's longest tool time, which "
        "evaluate.py fills in, so that no workflow is retired inside a tool call; never where there is none)",
        above(0))
    seed: int = knob(0, "seeds the lost end signals (evaluate.py sets it from seed or seeds)", at_least(0))

    def __post_init__(self):
        check(self)
        if self.replicas > 1 and self.routing == "none":
            names = ", ".join(n for n in _routers() if n != "none")
            raise ConfigError(f"replicas={self.replicas} needs a routing policy (routing: {names})")
        # null end-signal settings with no train split to derive them from: the signal comes with
        # the last call, and no workflow times out
        if self.end_signal_delay_s is None:
            object.__setattr__(self, "end_signal_delay_s", 0.0)
        if self.inactivity_timeout_s is None:
            object.__setattr__(self, "inactivity_timeout_s", math.inf)


def cost_model_preset(path) -> CostModel:
    """A conf/cost_model preset file read without Hydra (its defaults list aside), as a checked CostModel."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    values.pop("defaults", None)
    return build(values, CostModel, str(path))


def register_schemas() -> None:
    register("sim", SimConfig)
    register("cost_model", CostModel)


register_schemas()
