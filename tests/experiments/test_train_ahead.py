"""Two sweep jobs of one dataset that start together split its seeds' trainings between them
(evaluation.train_ahead), and each seed's predictor is trained once."""

import logging
import multiprocessing
import os

import pytest
from hydra import compose, initialize_config_dir

from data import store
from serving_integration.experiments.config import settings  # also registers the schemas conf/ names
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*treespec")]


def _job(cfg, logs) -> None:
    from serving_integration.experiments.evaluation import log, train_ahead

    log.setLevel(logging.INFO)
    handler = logging.FileHandler(logs / f"{os.getpid()}.log")
    handler.setFormatter(logging.Formatter("%(created)f %(message)s"))
    log.addHandler(handler)
    knobs = settings(cfg)
    train_ahead(knobs, [store.resolve_seeded(cfg.data, seed) for seed in knobs.run.seeds])


def test_two_jobs_of_one_dataset_split_its_trainings(tmp_path):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=[
            "debug=evaluate", f"data.cache_dir={tmp_path / 'data'}", f"predictor.cache_dir={tmp_path / 'predictors'}",
            "predictor.train=graphsage", "predictor.train_overrides=['debug=train']", "seeds=[0,1,2,3]",
            "policies=[lru,pbkv]"])
    for seed in range(4):  # the datasets first, so that both jobs reach the trainings together
        store.resolve_seeded(cfg.data, seed)
    logs = tmp_path / "logs"
    logs.mkdir()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.starmap(_job, [(cfg, logs)] * 2)
    trained = [[line.split() for line in f.read_text().splitlines() if " training graphsage " in line]
               for f in logs.iterdir()]
    assert len(trained) == 2 and all(trained), trained  # each job trained some
    assert sum(map(len, trained)) == 4  # and no predictor twice
    assert len(list((tmp_path / "predictors").glob("graphsage-*/predictor.pt"))) == 4
    # side by side, not taking turns: a training of one job began before one of the other's ended
    spans = [[(float(words[0]), os.path.getmtime(words[-1] + "/predictor.pt")) for words in job] for job in trained]
    assert any(a0 < b1 and b0 < a1 for a0, a1 in spans[0] for b0, b1 in spans[1]), spans
