"""The dataset store: workflow-level seeded splits, atomic save, load, and the data config group."""

import json
import multiprocessing
import time

import pytest
from hydra import compose, initialize_config_dir

from data import store
from data.cli import CONF_DIR
from data.schema import SPLITS


def test_split_keeps_workflows_whole_and_is_seeded(hover_small):
    ds = store.build(hover_small, val=0.2, test=0.2, seed=1)
    owners = {}
    for split in SPLITS:
        for wid in ds.calls[split]["workflow_id"]:
            assert owners.setdefault(wid, split) == split
    assert len(owners) == 40 and ds.meta["splits"]["val"]["workflows"] == 8
    assert sum(ds.calls[s].num_rows for s in SPLITS) == len(hover_small.calls)
    again = store.build(hover_small, val=0.2, test=0.2, seed=1)
    other = store.build(hover_small, val=0.2, test=0.2, seed=2)
    assert again.calls["test"]["workflow_id"] == ds.calls["test"]["workflow_id"]
    assert other.calls["test"]["workflow_id"] != ds.calls["test"]["workflow_id"]


def test_small_sources_keep_every_split():
    assert sorted(set(store.assign_splits(["a", "b", "c"], 0.1, 0.1, 0).values())) == ["test", "train", "val"]
    with pytest.raises(ValueError, match="split fractions"):
        store.assign_splits(["a"], 0.6, 0.5, 0)


def test_save_load_round_trip(tmp_path, hover_small):
    ds = store.build(hover_small)
    out = store.save(ds, tmp_path / "ds")
    assert sorted(p.name for p in (out / "parquet").iterdir()) == ["segments.parquet", "test.parquet",
                                                                    "train.parquet", "val.parquet"]
    back = store.load(out)
    assert back.rows() == ds.rows() and back.meta == json.loads(json.dumps(ds.meta))
    assert back.segment_table() == {k: dict(v) for k, v in hover_small.segments.items()}
    with pytest.raises(FileExistsError):
        store.save(ds, out)
    store.save(ds, out, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no temporary or old copies left


def test_failed_save_leaves_nothing(tmp_path, hover_small, monkeypatch):
    ds = store.build(hover_small)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(ds.segments), "to_parquet", broken)
    with pytest.raises(OSError):
        store.save(ds, tmp_path / "ds")
    assert list(tmp_path.iterdir()) == []


def test_load_rejects_non_dataset_and_other_schema(tmp_path, hover_small):
    with pytest.raises(FileNotFoundError, match="not a trace dataset"):
        store.load(tmp_path)
    out = store.save(store.build(hover_small), tmp_path / "ds")
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "schema_version": 0}))
    with pytest.raises(ValueError, match="schema version 0"):
        store.load(out)


def data_config(*overrides):
    """The `data` node as train.py composes it."""
    import models.config  # noqa: F401  (registers train.yaml's schemas)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides)).data


def test_data_group_builds_once_and_caches(tmp_path):
    cfg = data_config("data=swebench", "data.source.n_workflows=12", f"data.cache_dir={tmp_path}")
    ds = store.resolve(cfg)
    assert ds.n_workflows == 12 and ds.meta["workload"] == "swebench"
    (cached,) = (p for p in tmp_path.iterdir() if not p.name.startswith("."))  # its lock file beside it
    stamp = (cached / "meta.json").stat().st_mtime_ns
    again = store.resolve(cfg)
    assert again.path == cached and (cached / "meta.json").stat().st_mtime_ns == stamp
    other = store.resolve(data_config("data=swebench", "data.source.n_workflows=13", f"data.cache_dir={tmp_path}"))
    assert other.path != cached and other.n_workflows == 13


def _build_counted(cached, hover_small, counter):
    def make():
        with open(counter, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough for the other process to ask meanwhile
        return store.build(hover_small)
    return store.cached_build(cached, make).n_workflows


def test_parallel_jobs_asking_for_one_dataset_build_it_once(tmp_path, hover_small):
    """Two sweep jobs that need the same cache entry at once: one builds it, the other waits and loads it."""
    cached, counter = tmp_path / "cache" / "hover-abc", tmp_path / "builds.txt"
    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        sizes = pool.starmap(_build_counted, [(cached, hover_small, counter)] * 2)
    assert sizes == [40, 40] and counter.read_text() == "built\n"


def _held_elsewhere(entry) -> bool:
    from data.atomic import built_once

    with built_once(entry, wait=False) as held:
        return held


def test_a_job_can_leave_an_entry_another_is_building_for_later(tmp_path):
    """built_once(wait=False), as evaluation.train_ahead asks: False at once while another process
    holds the entry's lock, True once it is free."""
    from data.atomic import built_once

    entry = tmp_path / "cache" / "graphsage-abc"
    with multiprocessing.get_context("fork").Pool(1) as pool:
        with built_once(entry) as held:
            assert held and pool.apply_async(_held_elsewhere, (entry,)).get(timeout=30) is False
        assert pool.apply_async(_held_elsewhere, (entry,)).get(timeout=30) is True


def test_data_path_selects_a_written_dataset(tmp_path, hover_small):
    out = store.save(store.build(hover_small), tmp_path / "mine")
    ds = store.resolve(data_config("data=hover", f"data.path={out}", f"data.cache_dir={tmp_path}/cache"))
    assert ds.path == out and not (tmp_path / "cache").exists()


def test_empty_split_survives_save_and_load(tmp_path, hover_small):
    two = type(hover_small)([c for c in hover_small.calls if c["workflow_id"] in ("hover-000000", "hover-000001")],
                            hover_small.segments, hover_small.meta)
    back = store.load(store.save(store.build(two), tmp_path / "ds"))
    assert back.calls["test"].num_rows == 0 and back.calls["test"].features == back.calls["train"].features
    assert len(back.rows()) == len(two.calls)
