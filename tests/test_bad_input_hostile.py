"""Hostile inputs and killed writers: a file the project reads names no code, a kill never loses the
last output, a loader is all-or-nothing and bounded, the plugin's state survives one bad round and
stays bounded. Each case and its test:

| case | test |
|---|---|
| plugin: one NaN round under the online backoff, then healthy rounds | test_one_nan_round_is_one_fallback_round |
| plugin: 20,000 workflows that never end | test_never_ended_workflows_leave_the_ledger_at_its_bound |
| plugin: a ledger bound that is not a positive integer | test_the_ledger_bound_must_be_a_positive_integer |
"""

import math
import types

import numpy as np
import pytest
import torch

from models import load_predictor, save_predictor
from models.markov import MarkovPredictor
from serving_integration.cache.predictions import ModelSource, OnlineBackoff
from serving_integration.server.runtime import PluginConfig, WorkflowRuntime


# -------------------------------------------------------------------- the plugin's runtime (no server)


def served(runtime, rid, workflow, agent, step, nodes=()):
    """One call of `workflow` through the runtime, as the plugin's hooks report it."""
    req = types.SimpleNamespace(rid=rid, kv_hints=None, sampling_params=types.SimpleNamespace(
        custom_params={"pbkv": {"workflow_id": workflow, "agent": agent, "step": step, "workflow_end": False}}))
    runtime.on_cached(req, list(nodes))
    runtime.on_finished(req)


class NaNOnce:
    """The real checkpoint's source, answering NaN on one chosen round only."""

    def __init__(self, source, bad_round):
        self.source, self.bad_round, self.rounds = source, bad_round, 0
        self.agent_names, self.horizon = source.agent_names, source.horizon

    def predict(self, workflows):
        self.rounds += 1
        probs = self.source.predict(workflows)
        return torch.full_like(probs, math.nan) if self.rounds == self.bad_round else probs


def test_one_nan_round_is_one_fallback_round(tmp_path):
    """Under the default online backoff a NaN round reaches neither its weights nor the trust meter:
    the next healthy round is used (the predictor is back, the backoff's weights finite)."""
    checkpoint = save_predictor(MarkovPredictor.from_sequences(["<unk>", "a", "b"], 2, [[1, 1, 1, 1, 2]] * 4,
                                                               order=1), tmp_path / "predictor.pt")
    config = PluginConfig(checkpoint=str(checkpoint), predictor_timeout_s=0)
    backoff = OnlineBackoff(NaNOnce(ModelSource(load_predictor(checkpoint)), bad_round=3), config.online_beta)
    runtime = WorkflowRuntime("pbkv", config, backoff)  # the warm-up is round 1
    served(runtime, "r1", "A", "a", 0, [1])
    runtime.run_predictions()  # round 2: healthy
    assert not runtime.degraded
    served(runtime, "r2", "A", "a", 1, [2])
    runtime.run_predictions()  # round 3: NaN
    assert runtime.degraded and runtime.stats["predictor_nan"] == 1
    assert np.isfinite(backoff.log_weight).all()
    served(runtime, "r3", "A", "a", 2, [3])
    runtime.run_predictions()  # round 4: healthy again, and used
    assert not runtime.degraded and runtime.stats["predictor_nan"] == 1 and runtime.stats["predictor_calls"] == 2
    assert np.isfinite(backoff.log_weight).all() and np.isfinite(backoff.weights).all()
    assert math.isfinite(runtime.policy.meter.quality) and runtime.policy.meter.trusted
    served(runtime, "r4", "A", "a", 3, [4])
    runtime.run_predictions()  # and the rounds after it
    assert not runtime.degraded and runtime.stats["predictor_calls"] == 3


def test_never_ended_workflows_leave_the_ledger_at_its_bound():
    """20,000 workflows that never send their end signal: the ledger stays at max_live_workflows, the
    longest-silent ones retired first and counted; a workflow with a call in flight is kept."""
    runtime = WorkflowRuntime("pbkv_lae", PluginConfig(max_live_workflows=3000, prefetch="none"))
    busy = types.SimpleNamespace(rid="busy", kv_hints=None, sampling_params=types.SimpleNamespace(
        custom_params={"pbkv": {"workflow_id": "busy", "agent": "a", "step": 0, "workflow_end": False}}))
    runtime.on_cached(busy, [0])  # in flight for the whole test
    for i in range(3000 + 20000):
        served(runtime, f"r{i}", f"w{i}", "a", 0, [i + 1])
        runtime.on_scheduler_step()
    assert len(runtime.workflows) == 3000 and len(runtime.ledger.nodes_of) <= 3000 + 1
    assert runtime.stats["workflows_evicted_by_bound"] == 20000 + 1  # the busy one counts among the live
    assert "busy" in runtime.workflows and f"w{3000 + 20000 - 1}" in runtime.workflows and "w0" not in runtime.workflows
    assert runtime.ledger.is_retired(1) and not runtime.ledger.is_retired(23000)


@pytest.mark.parametrize("bound", [0, -1, 1.5, True, "10"])
def test_the_ledger_bound_must_be_a_positive_integer(bound):
    with pytest.raises(ValueError, match="max_live_workflows must be an integer >= 1"):
        PluginConfig(max_live_workflows=bound)
