"""Time until the next calls (models/timing.py): the Markov quantiles against the empirical ones,
a neural head learning a gap, the metrics, the fallback without gaps, the next-agent predictions
left exactly as they were, and checkpoints (CPU, seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data import store
from data.generators import Hover
from models import WorkflowPrefix, load_predictor, save_predictor
from models.config import TimeConfig
from models.datamodule import TraceDataModule
from models.graphsage import GraphSAGEPredictor
from models.markov import MarkovPredictor
from models.metrics import time_metrics
from models.module import PredictorModule
from models.text import HashingTextEncoder
from models.timing import GapPools, TimeSpec, agent_table, times_until
from tests.models.test_models import build

K = 3
LEVELS = [0.1, 0.5, 0.9]
FAMILIES = ["markov", "graphsage", "rgcn", "intent_residual"]
CLAIM = "Verify the claim against Wikipedia. Claim: The director of Copper Sky was born in Porto."


def hover_dataset(gap=None, seed=0):
    """40 hover workflows; `gap`: every call after the first gets this tool_time instead (0: none)."""
    ds = store.build(Hover().generate(40, seed=seed), val=0.2, test=0.2, seed=0)
    if gap is not None:
        for split in ds.calls:
            ds.calls[split] = ds.calls[split].map(lambda r: {"tool_time": gap if r["step"] > 0 else 0.0})
    return ds


def datamodule_of(ds, **time) -> TraceDataModule:
    dm = TraceDataModule(dataset=ds, horizon=K, seed=0, max_path=8, batch_size=64,
                         text_encoder=HashingTextEncoder(dim=64), time=TimeConfig(**time))
    dm.setup()
    return dm


@pytest.fixture(scope="module")
def datamodule() -> TraceDataModule:
    return datamodule_of(hover_dataset())


def attach(predictor, dm):
    predictor.text_features.attach(dm.text_encoder if predictor.text_spec.source == "encoder" else None)
    return predictor


def prefixes() -> list[WorkflowPrefix]:
    return [WorkflowPrefix(["retriever"], CLAIM), WorkflowPrefix(["retriever", "summarizer", "verifier"], "other")]


# ------------------------------------------------------------------ definitions
def test_time_until_step_k_sums_the_next_k_gaps():
    times = times_until([0.0, 1.0, 2.0, 4.0], 3)
    np.testing.assert_array_equal(times[0], [1.0, 3.0, 7.0])
    np.testing.assert_array_equal(times[2], [4.0, np.nan, np.nan])
    assert np.isnan(times[3]).all()  # after the last call: END, no time


def test_examples_carry_the_times_exactly_where_a_call_arrives(datamodule):
    path, n_calls, text, labels, times = datamodule.splits["train"][:]
    end = len(datamodule.corpus.agent_names)
    arrives = (labels >= 0) & (labels != end)
    assert torch.equal(~torch.isnan(times), arrives)
    assert datamodule.corpus.time_source == "tool_time" and (times[arrives] > 0).any()


# ------------------------------------------------------------------ Markov
def hand_chain(first_gaps, second_gaps):
    """a -> b -> c, one workflow per pair of gaps: the a -> b gap, then the b -> c one."""
    names = ["<unk>", "a", "b", "c"]
    sequences = [[1, 2, 3] for _ in first_gaps]
    gaps = [[0.0, g1, g2] for g1, g2 in zip(first_gaps, second_gaps)]
    table = agent_table(sequences, gaps, len(names) + 1, 2, LEVELS, 5)
    spec = TimeSpec(LEVELS, 0.1, "tool_time", table, min_samples=5, paths=4000)
    return MarkovPredictor.from_sequences(names, 2, sequences, time=spec, gaps=gaps, order=1)


def test_markov_quantiles_equal_the_empirical_ones_of_the_transition():
    rng = np.random.default_rng(0)
    first, second = rng.lognormal(0.0, 1.0, 40).round(3), rng.lognormal(2.0, 0.5, 40).round(3)
    markov = hand_chain(first, second)
    _, seconds = markov.predict_when([WorkflowPrefix(["a"]), WorkflowPrefix(["a", "b"])])
    expected_ab = np.quantile(first, LEVELS, method="inverted_cdf")
    expected_bc = np.quantile(second, LEVELS, method="inverted_cdf")
    np.testing.assert_allclose(seconds[0, 0].numpy(), expected_ab, rtol=1e-6)  # exact: the mixture is a -> b's
    np.testing.assert_allclose(seconds[1, 0].numpy(), expected_bc, rtol=1e-6)
    # step 2 after a: a -> b's gap plus b -> c's, summed along sampled paths
    sums = (first[:, None] + second[None, :]).ravel()
    np.testing.assert_allclose(seconds[0, 1].numpy(), np.quantile(sums, LEVELS), rtol=0.1)


def test_rare_transitions_back_off_to_the_agent_then_to_all_gaps():
    previous = np.array([1] * 6 + [1, 2])
    following = np.array([2] * 6 + [3, 3])
    seconds = np.array([1.0] * 6 + [50.0, 7.0])
    pools = GapPools(previous, following, seconds, n_agents=4, min_samples=5)
    assert sorted(pools.pools[pools.pool_id[1, 2]]) == [1.0] * 6  # its own: 6 samples
    assert sorted(pools.pools[pools.pool_id[1, 3]]) == [1.0] * 6 + [50.0]  # 1 sample: agent 1's
    assert sorted(pools.pools[pools.pool_id[2, 3]]) == sorted(seconds)  # agent 2 has 1: all gaps
    assert pools.pool_id[4].tolist() == [0] * 4  # no previous agent: all gaps


# ------------------------------------------------------------------ neural heads
def train_time(predictor, dm, steps=300):
    module = PredictorModule(predictor)
    optimizer = torch.optim.Adam(predictor.time_head.parameters(), lr=1e-2)
    batch = dm.splits["train"][:]
    predictor.train()
    for _ in range(steps):
        optimizer.zero_grad()
        _, time_loss, _, _ = module.losses(batch)
        time_loss.backward()
        optimizer.step()
    return predictor.eval()


@pytest.mark.parametrize("family", ["graphsage", "intent_residual"])
def test_a_time_head_learns_a_constant_gap(family):
    dm = datamodule_of(hover_dataset(gap=2.0))
    predictor = attach(build(family, dm.corpus), dm)
    spec = predictor.time_spec
    spec.table.zero_()  # a wrong start: the head has to learn the whole log(2 + c) - log(c)
    if family == "intent_residual":
        predictor.prior.time_table.zero_()
    _, before = predictor.predict_when(prefixes())
    assert torch.all(before == 0)
    train_time(predictor, dm)
    _, seconds = predictor.predict_when(prefixes())
    median = seconds[..., LEVELS.index(0.5)]
    torch.testing.assert_close(median[0], torch.tensor([2.0, 4.0, 6.0]), rtol=0.1, atol=0.0)


def test_the_time_loss_reaches_only_the_time_head(datamodule):
    predictor = attach(build("graphsage", datamodule.corpus), datamodule).train()
    _, time_loss, _, _ = PredictorModule(predictor).losses(datamodule.splits["train"][:64])
    time_loss.backward()
    head = {id(p) for p in predictor.time_head.parameters()}
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in predictor.time_head.parameters())
    assert all(p.grad is None for p in predictor.parameters() if id(p) not in head)


def test_next_agent_predictions_stay_identical_with_the_time_head(datamodule):
    """Same seed, with and without a head: the same initial weights, the same training steps under
    dropout with the time loss added, the same next-agent predictions."""
    def trained(with_head: bool):
        torch.manual_seed(0)
        predictor = attach(build("graphsage", datamodule.corpus), datamodule)
        if not with_head:  # the same predictor as it was before times existed
            args = {**predictor.init_args()}
            args.pop("time")
            torch.manual_seed(0)
            predictor = attach(GraphSAGEPredictor(**args), datamodule)
            assert predictor.time_spec is None
        module = PredictorModule(predictor)
        optimizer = torch.optim.AdamW(predictor.parameters(), lr=1e-2)
        predictor.train()
        for start in range(0, 256, 64):
            batch = datamodule.splits["train"][start:start + 64]
            optimizer.zero_grad()
            if with_head:
                loss, time_loss, _, _ = module.losses(batch)
                (loss + time_loss).backward()
            else:
                path, n_calls, text, labels, _ = batch
                logits = predictor(predictor.example_batch(path, n_calls, text))
                torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                  ignore_index=-100).backward()
            optimizer.step()
        return predictor.eval()

    with_head, without = trained(True), trained(False)
    shared = {k: v for k, v in with_head.state_dict().items() if not k.startswith("time_head.")}
    assert shared.keys() == without.state_dict().keys()
    assert all(torch.equal(v, without.state_dict()[k]) for k, v in shared.items())
    assert torch.equal(with_head.predict(prefixes()), without.predict(prefixes()))
    assert torch.equal(with_head.predict_when(prefixes())[0], without.predict(prefixes()))


# ------------------------------------------------------------------ the interface, fallback, metrics, checkpoints
@pytest.mark.parametrize("family", FAMILIES)
def test_predict_when_gives_ordered_non_negative_quantiles_beside_unchanged_probabilities(family, datamodule):
    predictor = attach(build(family, datamodule.corpus), datamodule)
    probs, seconds = predictor.predict_when(prefixes())
    assert torch.equal(probs, predictor.predict(prefixes()))
    assert seconds.shape == (2, K, len(LEVELS)) and predictor.time_quantiles == LEVELS
    assert torch.all(seconds >= 0) and torch.all(seconds.diff(dim=-1) >= 0)
    assert not predictor.time_fallback


@pytest.mark.parametrize("family", FAMILIES)
def test_traces_without_gaps_fall_back_to_the_per_agent_table(family):
    dm = datamodule_of(hover_dataset(gap=0.0))
    predictor = attach(build(family, dm.corpus), dm)
    assert dm.corpus.time_source == "none" and predictor.time_fallback
    assert getattr(predictor, "time_head", None) is None
    _, seconds = predictor.predict_when(prefixes())
    assert torch.all(seconds == 0)


def test_time_metrics_on_a_known_case():
    log_time = np.log(np.array([[[1.0, 2.0, 4.0]], [[1.0, 2.0, 4.0]]]) + 0.1)
    times = np.array([[2.0], [8.0]])
    m = time_metrics(log_time, times, LEVELS, 0.1, "test")
    assert np.isclose(m["test/time_mae_log_k1"], np.log(8.1 / 2.1) / 2)
    assert m["test/time_below_q10"] == m["test/time_at_or_below_q10"] == 0.0
    assert m["test/time_below_q50"] == 0.0 and m["test/time_at_or_below_q50"] == 0.5  # 2 s is the median: a tie
    assert m["test/time_below_q90"] == m["test/time_at_or_below_q90"] == 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_is_reported_for_every_step_and_quantile(family, datamodule):
    predictor = attach(build(family, datamodule.corpus), datamodule)
    module = PredictorModule(predictor)
    _, _, _, log_time = module.losses(datamodule.splits["test"][:])
    m = time_metrics(log_time.detach().double().numpy(), datamodule.splits["test"][:][4].double().numpy(),
                     LEVELS, 0.1, "test")
    for suffix in ["_k1", "_k2", "_k3", ""]:
        for q in ("q10", "q50", "q90"):
            assert 0.0 <= m[f"test/time_below_{q}{suffix}"] <= m[f"test/time_at_or_below_{q}{suffix}"] <= 1.0
        assert m[f"test/time_mae_log{suffix}"] >= 0
    assert m["test/time_at_or_below_q10"] <= m["test/time_at_or_below_q50"] <= m["test/time_at_or_below_q90"]


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_round_trip_keeps_the_times(family, datamodule, tmp_path):
    predictor = attach(build(family, datamodule.corpus), datamodule)
    head = getattr(predictor, "time_head", None)
    if head is not None:
        with torch.no_grad():
            for p in head.parameters():
                p.add_(0.05 * torch.randn_like(p))
    loaded = load_predictor(save_predictor(predictor, tmp_path / "p.pt"))
    attach(loaded, datamodule)
    expected, got = predictor.predict_when(prefixes()), loaded.predict_when(prefixes())
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert loaded.time_quantiles == predictor.time_quantiles and loaded.time_spec.source == "tool_time"


def test_a_checkpoint_from_before_times_says_so(datamodule, tmp_path):
    predictor = build("markov", datamodule.corpus)
    args = predictor.init_args()
    args.pop("time"), args.pop("gaps")
    old = MarkovPredictor(**args)
    with pytest.raises(ValueError, match="before predictors gave times"):
        old.predict_when(prefixes())
    torch.testing.assert_close(old.predict(prefixes()), predictor.predict(prefixes()))


def test_the_predictors_page_table_shows_the_time_metrics(datamodule, tmp_path):
    from benchmarks.predictor_table import format_time_table
    from models.training import time_fields

    predictor = build("markov", datamodule.corpus)
    module = PredictorModule(predictor)
    batch = datamodule.splits["test"][:]
    _, _, _, log_time = module.losses(batch)
    metrics = time_metrics(log_time.double().numpy(), batch[4].double().numpy(), LEVELS, 0.1, "test")
    run = tmp_path / "0_markov"
    checkpoint = save_predictor(predictor, run / "predictor.pt")
    (run / "metrics.json").write_text(__import__("json").dumps({**metrics, **time_fields(predictor),
                                                                "checkpoint": str(checkpoint)}))
    table = format_time_table([tmp_path]).splitlines()
    assert table[0].startswith("| family | runs | gaps from | MAE log k=1 |") and len(table) == 3
    assert table[2].startswith("| markov | 1 | tool_time | ") and f"{metrics['test/time_mae_log_k1']:.3f}" in table[2]
