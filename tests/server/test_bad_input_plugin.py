"""The plugin's predictor guard: whatever a predictor raises or returns, the scheduler gets a
valid [B, K, A+1] distribution or None (counted, the round falls back); only the scheduler's own
shutdown passes through."""

import os
import signal
import time

import pytest
import torch

from serving_integration.server.runtime import GuardedPredictor, LiveWorkflow, PluginStats, SchedulerShutdown


class Source:
    agent_names = ["plan", "code"]
    horizon = 2

    def __init__(self, answer):
        self.answer = answer

    def predict(self, workflows):
        return self.answer(len(workflows)) if callable(self.answer) else self.answer


def uniform(batch, k=2, a=3):
    return torch.full((batch, k, a), 1 / a)


def raising(error):
    def answer(batch):
        raise error
    return answer


def batch(n=2):
    return [LiveWorkflow(f"w{i}", agents=["plan"]) for i in range(n)]


@pytest.fixture(autouse=True)
def not_stopping():
    SchedulerShutdown._flag.clear()
    yield
    SchedulerShutdown._flag.clear()


@pytest.mark.parametrize("timeout", [None, 0.5])
@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt(), GeneratorExit(), MemoryError(),
                                   RuntimeError("boom")])
def test_anything_raised_by_the_predictor_is_a_counted_fallback(timeout, error):
    stats = PluginStats()
    guard = GuardedPredictor(Source(raising(error)), stats, timeout)
    assert guard.predict(batch()) is None and guard.predict(batch()) is None
    assert stats["predictor_error"] == 2 and stats["predictor_calls"] == 0


@pytest.mark.parametrize("error", [SystemExit(0), KeyboardInterrupt()])
def test_the_schedulers_own_shutdown_passes_through(error):
    SchedulerShutdown._flag.set()
    with pytest.raises(type(error)):
        GuardedPredictor(Source(raising(error)), PluginStats(), None).predict(batch())


def test_a_sigint_while_the_predictor_runs_stops_the_scheduler():
    previous = signal.getsignal(signal.SIGINT)

    def interrupted(batch):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
        pytest.fail("no KeyboardInterrupt")
    try:
        # Python's own handler, whatever the test runner inherited (a background job ignores SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        guard = GuardedPredictor(Source(interrupted), PluginStats(), None)
        with pytest.raises(KeyboardInterrupt):
            guard.predict(batch())
        assert SchedulerShutdown.stopping()
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("name, answer, reason", [
    ("horizon", lambda b: uniform(b, k=3), "invalid"),
    ("agents", lambda b: uniform(b, a=4), "invalid"),
    ("batch", lambda b: uniform(b + 1), "invalid"),
    ("rank", lambda b: torch.full((b, 3), 1 / 3), "invalid"),
    ("integer", lambda b: torch.ones(b, 2, 3, dtype=torch.long), "invalid"),
    ("list", lambda b: [[0.5, 0.5]], "invalid"),
    ("none", lambda b: None, "invalid"),
    ("nan", lambda b: uniform(b).index_put_((torch.tensor(0),), torch.tensor(float("nan"))), "nan"),
    ("inf", lambda b: uniform(b) * float("inf"), "nan"),
    ("above one", lambda b: torch.tensor([[1.5, -0.25, -0.25]]).expand(b, 2, 3).clone(), "invalid"),
    ("logits", lambda b: torch.tensor([[2.0, 1.0, -3.0]]).expand(b, 2, 3).clone(), "invalid"),
    ("sum below one", lambda b: uniform(b) / 2, "invalid"),
    ("sum above one", lambda b: torch.tensor([[0.9, 0.9, 0.0]]).expand(b, 2, 3).clone(), "invalid"),
])
def test_predictions_that_are_not_distributions_fall_back(name, answer, reason):
    stats = PluginStats()
    guard = GuardedPredictor(Source(answer), stats, None)
    assert guard.predict(batch()) is None
    assert stats[f"predictor_{reason}"] == 1 and stats["predictor_calls"] == 0


def test_valid_predictions_pass_within_the_tolerance():
    stats = PluginStats()
    probs = torch.softmax(torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(0)), dim=-1)
    guard = GuardedPredictor(Source(probs), stats, None)
    assert guard.predict(batch()) is probs
    slightly_off = probs * (1 + 1e-5)
    assert GuardedPredictor(Source(slightly_off), stats, None).predict(batch()) is slightly_off
    assert stats["predictor_calls"] == 2 and stats["predictor_invalid"] == 0
