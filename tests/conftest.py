import os
from pathlib import Path

import pytest

# Offline always: no W&B upload, no hub access (docs/install.md).
os.environ["WANDB_MODE"] = "offline"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

REPO = Path(__file__).resolve().parents[1]
from data import cpu_kernels  # noqa: E402

cpu_kernels.pin()  # before a test loads torch: trainings in this process match train.py's (data/cpu_kernels.py)
from data.published import TRACES_DIR as TRACES  # noqa: E402  (data/traces, or PBKV_TRACES_DIR)

WHO_AND_WHEN = TRACES / "who_and_when"
TAU_BENCH = TRACES / "tau_bench" / "gpt-4o-airline.json"


@pytest.fixture(scope="session")
def counter():
    from data.tokenizer import TokenCounter

    return TokenCounter.wordpiece()


@pytest.fixture(scope="session")
def hover_small():
    from data.generators import Hover

    return Hover().generate(40, seed=3)


def assert_bad_setting(base, check, key, value, message):
    """Setting `key` to `value` in a valid composed config fails `check(cfg)` (a function that
    builds the checked config, e.g. models.config.train_config) with exactly `message`."""
    import pytest
    from omegaconf import OmegaConf

    from data.errors import ConfigError

    cfg = base.copy()
    OmegaConf.update(cfg, key, value, merge=False)
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == message


def refused_over_its_dataset(entry, work: str, base, tmp_path, capsys, monkeypatch):
    """An entry point (`entry.run`) refuses a run folder that is, or holds, its dataset (`data.path`):
    exit status 1 naming the input, and `work` (a dotted path) never called. Returns the config used."""
    import pytest
    from omegaconf import OmegaConf

    from data.errors import run_reported

    dataset = tmp_path / "ds"
    dataset.mkdir()
    (dataset / "meta.json").write_text("{}")
    monkeypatch.setattr(work, lambda *a, **k: pytest.fail(f"{work} ran into its input"))
    cfg = base.copy()
    OmegaConf.update(cfg, "data.path", str(dataset), merge=False)
    for run_dir in (dataset, tmp_path):
        assert run_reported(entry.run, cfg, run_dir) == 1
        assert "input" in capsys.readouterr().err
    return cfg
