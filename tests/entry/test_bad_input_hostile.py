"""Hostile inputs and killed writers: a file the project reads names no code, a kill never loses the
last output, an output goes only where the command may write, a loader is all-or-nothing and
bounded, the plugin's state survives one bad round and stays bounded. Bad settings exit 2 and bad
data or a refused output exit 1, in one line (a trace file's issues: one line each, documented),
writing nothing and leaving the previous output intact. Each case and its test:

| case | test |
|---|---|
| meta.json recipe naming builtins.open / shutil.copyfile / os.makedirs (either layout, as workload or parameter) | test_a_crafted_recipe_runs_nothing |
| the same through `evaluate.py data.path=DS seeds=[0,1]` | test_a_crafted_recipe_through_evaluate_exits_1_in_one_line |
| meta.json written by the earlier code still re-creates its dataset | test_an_earlier_plain_recipe_still_recreates_the_dataset |
| a `data` config records its recipe as registry name + parameters | test_the_data_config_records_its_recipe_as_plain_values |
| cost-model preset naming a callable (validate_sim, calibrate's presets, evaluate's group) | test_a_preset_naming_a_callable_builds_nothing |
| results plan running other code (-c, -m shutil, _target_, hydra.callbacks, --config-dir) | test_a_plan_naming_code_runs_nothing, test_the_committed_plan_is_values_only |
| malformed / too deep / non-object meta.json, bad split sizes, a table missing a column, negative token counts, steps out of order, an unreadable table | test_a_damaged_dataset_is_one_line_naming_its_file |
| data.generate killed before each rename | test_data_generate_killed_at_every_rename_keeps_the_old_or_the_new_dataset |
| train.py killed before each rename (config, checkpoint, metrics of one run) | test_train_killed_at_every_rename_keeps_one_whole_run |
| evaluate.py killed before each rename (no summary beside another run's PNGs) | test_evaluate_killed_at_every_rename_never_mixes_two_runs |
| report --out and the results page killed before each rename | test_report_and_results_killed_at_every_rename_keep_a_whole_output |
| hydra.run.dir holding foreign files, the repository root or its parent | test_a_run_dir_holding_what_the_command_did_not_write_is_refused |
| checkpoint_name=metrics.json, ../../escaped.pt, a folder, a dot file | test_checkpoint_name_is_a_file_name |
| hydra.run.dir = the input dataset, through the real entry point (nothing written by Hydra) | test_a_run_dir_on_the_input_dataset_is_refused_before_hydra_writes |
| validate_sim --out = --data / the folder of --real-from; calibrate --out = --calls, --name ../../x; results --out = --plan / RUNS/steps.json | test_argparse_commands_never_write_over_their_inputs |
| a Who&When subset folder or run file that cannot be read | test_an_unreadable_subset_fails_the_whole_import |
| a Who&When subset that is a symlink to itself | test_a_subset_that_links_to_itself_is_refused |
| chat src that is a FIFO with no writer, a device, a socket, a symlink loop | test_a_source_that_is_not_a_regular_file_is_refused |
| tau-bench / chat JSON nested beyond the recursion limit | test_json_nested_beyond_the_recursion_limit_is_an_issue |
| chat lines where only some carry `step` | test_chat_lines_where_only_some_carry_a_step_are_refused |
| plugin: one NaN round under the online backoff, then healthy rounds | test_one_nan_round_is_one_fallback_round |
| plugin: 20,000 workflows that never end | test_never_ended_workflows_leave_the_ledger_at_its_bound |
| plugin: a ledger bound that is not a positive integer | test_the_ledger_bound_must_be_a_positive_integer |
"""

import json
import math
import os
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data import CONF_DIR, REPO, store
from data.atomic import MARKER
from data.errors import run_reported
from models import load_predictor, save_predictor
from models.markov import MarkovPredictor
from serving_integration.cache.predictions import ModelSource, OnlineBackoff
from serving_integration.server.runtime import PluginConfig, WorkflowRuntime


def chat_line(**over):
    """One valid line of the chat format, with `over` replacing its fields."""
    rec = {"workflow_id": "t1", "agent": "coder", "completion": "def f(): return 1",
           "messages": [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Fix bug 7."}]}
    return json.dumps({**rec, **over})


def one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def compose_evaluate(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="evaluate", overrides=overrides)


# -------------------------------------------------------------------- the plugin's runtime (no server)


def served(runtime, rid, workflow, agent, step, nodes=()):
    """One call of `workflow` through the runtime, as the plugin's hooks report it."""
    req = types.SimpleNamespace(rid=rid, kv_hints=None, origin_input_ids=[0] * 8, output_ids=[0] * 2,
                                sampling_params=types.SimpleNamespace(custom_params={"pbkv": {
                                    "workflow_id": workflow, "agent": agent, "step": step, "workflow_end": False}}))
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
    config = PluginConfig(checkpoint=str(checkpoint), predictor_timeout_s=0, trust="accuracy")
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
    assert math.isfinite(runtime.policy.judge.meter.quality) and runtime.policy.judge.meter.trusted
    served(runtime, "r4", "A", "a", 3, [4])
    runtime.run_predictions()  # and the rounds after it
    assert not runtime.degraded and runtime.stats["predictor_calls"] == 3


def test_never_ended_workflows_leave_the_ledger_at_its_bound():
    """20,000 workflows that never send their end signal: the ledger stays at max_live_workflows, the
    longest-silent ones retired first and counted; a workflow with a call in flight is kept."""
    runtime = WorkflowRuntime("pbkv_lae", PluginConfig(max_live_workflows=3000, prefetch="none"))
    busy = types.SimpleNamespace(rid="busy", kv_hints=None, origin_input_ids=[0] * 8, output_ids=[],
                                 sampling_params=types.SimpleNamespace(custom_params={"pbkv": {
                                     "workflow_id": "busy", "agent": "a", "step": 0, "workflow_end": False}}))
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
    with pytest.raises(ValueError, match=r"^max_live_workflows=\S+: Input should be (greater than or equal to 1|a valid integer)$"):
        PluginConfig(max_live_workflows=bound)


# -------------------------------------------------------------------- datasets: values only, checked tables


@pytest.fixture(scope="module")
def stored(tmp_path_factory, hover_small):
    return store.save(store.build(hover_small), tmp_path_factory.mktemp("stored") / "ds")


@pytest.fixture
def dataset(stored, tmp_path):
    """A writable copy of a dataset written by the current code."""
    return Path(shutil.copytree(stored, tmp_path / "ds"))


def with_meta(dataset, **changes):
    meta = json.loads((dataset / "meta.json").read_text())
    meta.update(changes)
    (dataset / "meta.json").write_text(json.dumps(meta))
    return dataset


def seeded_config(dataset, tmp_path):
    return OmegaConf.create({"name": "crafted", "path": str(dataset), "cache_dir": str(tmp_path / "cache"),
                             "source": None, "split": {"val": 0.1, "test": 0.1, "seed": 0}})


def callables(marker):
    """Recipes that would run a callable creating `marker`, in both layouts meta.json has had."""
    split = {"val": 0.1, "test": 0.1, "seed": 0}
    calls = {"builtins.open": {"file": str(marker), "mode": "w"},
             "shutil.copyfile": {"src": __file__, "dst": str(marker)},
             "os.makedirs": {"name": str(marker)}}
    for target, args in calls.items():
        yield {"source": {"_target_": target, **args, "seed": 0}, "split": split}  # Hydra's layout
        yield {"source": {"_target_": "data.generators.generate", "n_workflows": 5, "seed": 0,
                          "workload": {"_target_": target, **args}}, "split": split}
        yield {"kind": "generated", "workload": "hover", "n_workflows": 5, "seed": 0, "split": split,
               "parameters": {"passage_tokens": {"_target_": target, **args}}}
        yield {"kind": "generated", "workload": target, "n_workflows": 5, "seed": 0, "split": split,
               "parameters": args}


def test_a_crafted_recipe_runs_nothing(dataset, tmp_path):
    marker = tmp_path / "marker"
    for recipe in callables(marker):
        with_meta(dataset, recipe=recipe)
        with pytest.raises(ValueError) as e:
            store.resolve_seeded(seeded_config(dataset, tmp_path), seed=1)
        assert str(dataset / "meta.json") in str(e.value) and "\n" not in str(e.value), e.value
        assert not marker.exists(), recipe
    assert not (tmp_path / "cache").exists()


def test_a_crafted_recipe_through_evaluate_exits_1_in_one_line(dataset, tmp_path, capsys):
    import evaluate

    marker = tmp_path / "marker"
    with_meta(dataset, recipe=next(callables(marker)))
    cfg = compose_evaluate([f"data.path={dataset}", "seeds=[0,1]", "policies=[lru]", "wandb=disabled"])
    assert run_reported(evaluate.run, cfg, tmp_path / "run") == 1
    assert "meta.json: field 'recipe'" in one_line(capsys)
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_an_earlier_plain_recipe_still_recreates_the_dataset(dataset, tmp_path):
    """meta.json as the code before wrote it (Hydra's config, the registry's own targets) still loads."""
    with_meta(dataset, recipe={"source": {"_target_": "data.generators.generate", "n_workflows": 6, "seed": 3,
                                          "workload": {"_target_": "data.generators.Hover", "passage_tokens": 24}},
                               "split": {"val": 0.2, "test": 0.2, "seed": 0}})
    again = store.resolve_seeded(seeded_config(dataset, tmp_path), seed=4)
    assert again.meta["seed"] == 4 and again.n_workflows == 6
    assert again.meta["recipe"] == {"kind": "generated", "workload": "hover", "parameters": {"passage_tokens": 24},
                                    "n_workflows": 6, "seed": 4, "split": {"val": 0.2, "test": 0.2, "seed": 0}}


def test_the_data_config_records_its_recipe_as_plain_values(tmp_path):
    from data.generators import WORKLOADS

    recipe = store.plain_recipe({"_target_": "data.generators.generate", "n_workflows": 5, "seed": 2,
                                 "workload": {"_target_": "data.generators.SweBench", "cue_noise": 0.2}},
                                {"val": 0.1, "test": 0.1, "seed": 0})
    assert recipe["workload"] == "swebench" and recipe["parameters"] == {"cue_noise": 0.2}
    assert "_target_" not in json.dumps(recipe) and recipe["workload"] in WORKLOADS
    with pytest.raises(ValueError, match="not a parameter of hover"):
        store.checked_recipe({"recipe": {**recipe, "workload": "hover", "parameters": {"nosuch": 1}}}, "meta.json")


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "meta.json").write_text("{not json"), "meta.json: corrupt meta.json"),
    (lambda d: (d / "meta.json").write_text("[" * 100_000 + "]" * 100_000), "meta.json: JSON nested too deeply"),
    (lambda d: (d / "meta.json").write_text("[1, 2]"), "meta.json: expected a JSON object"),
    (lambda d: with_meta(d, splits={"train": {"workflows": -1, "calls": 3}}), "field 'splits.train'"),
    (lambda d: with_meta(d, split="random"), "field 'split'"),
    (lambda d: with_meta(d, recipe=[1]), "field 'recipe': expected an object"),
    (lambda d: rewrite_table(d, "calls/train", lambda t: t.remove_columns("output_tokens")),
     "missing column(s) output_tokens"),
    (lambda d: rewrite_table(d, "calls/train", lambda t: t.map(lambda r: {"output_tokens": -5})),
     "field 'output_tokens': -5 in row 0; token counts are >= 0"),
    (lambda d: rewrite_table(d, "calls/test", lambda t: t.map(
        lambda r: {"prompt_segment_tokens": [-1] + r["prompt_segment_tokens"][1:]})),
     "field 'prompt_segment_tokens': -1 in row 0"),
    (lambda d: rewrite_table(d, "segments", lambda t: t.map(lambda r: {"tokens": -7})), "field 'tokens': -7"),
    (lambda d: rewrite_table(d, "calls/train", lambda t: t.map(lambda r, i: {"step": 5 if i == 1 else r["step"]},
                                                               with_indices=True)),
     "field 'step': workflow"),
    (lambda d: shutil.rmtree(d / "calls" / "val"), "calls/val: not a readable table"),
])
def test_a_damaged_dataset_is_one_line_naming_its_file(dataset, capsys, damage, message):
    damage(dataset)
    with pytest.raises(ValueError) as e:
        store.load(dataset)
    assert message in str(e.value) and "\n" not in str(e.value) and str(dataset) in str(e.value), e.value


def rewrite_table(dataset, name, change):
    from datasets import load_from_disk

    folder = dataset / name
    table = change(load_from_disk(str(folder)))
    table.save_to_disk(str(folder) + ".new")
    shutil.rmtree(folder)
    os.rename(str(folder) + ".new", folder)


# -------------------------------------------------------------------- presets and results plans: values only


def test_a_preset_naming_a_callable_builds_nothing(tmp_path, monkeypatch):
    from data.errors import ConfigError
    from serving_integration.experiments import validate_sim
    from serving_integration.simulator.config import cost_model_preset

    marker = tmp_path / "marker"
    presets = tmp_path / "conf" / "cost_model"
    presets.mkdir(parents=True)
    crafted = {"builtins.open": {"file": str(marker), "mode": "w"},
               "shutil.copyfile": {"src": __file__, "dst": str(marker)}, "os.makedirs": {"name": str(marker)}}
    for target, args in crafted.items():
        (presets / "cpu-tiny-llama.yaml").write_text(json.dumps({"_target_": target, **args}))
        monkeypatch.setattr(validate_sim, "CONF_DIR", tmp_path / "conf")
        with pytest.raises(ConfigError, match=r"_target_: not a setting of"):
            validate_sim.cpu_cost_model()
    good = json.loads(json.dumps(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "cost_model" / "qwen3-14b-h100.yaml"),
                                                        resolve=True)))
    for name, value in {"mfu": {"_target_": "os.makedirs", "name": str(marker)}, "nosuch": 1}.items():
        (presets / "p.yaml").write_text(json.dumps({**good, name: value}))
        with pytest.raises(ConfigError, match=f"p.yaml.{name}"):
            cost_model_preset(presets / "p.yaml")
    assert not marker.exists()


@pytest.mark.parametrize("command, reason", [
    ("-c \"open('MARKER', 'w')\"", "-c: a plan runs train.py, evaluate.py or -m MODULE"),
    ("-m shutil MARKER", "-m shutil: a plan runs only the project's modules"),
    ("train.py +hydra.callbacks.x._target_=builtins.open +hydra.callbacks.x.file=MARKER", "names code"),
    ("evaluate.py cost_model._target_=os.makedirs +cost_model.name=MARKER", "names code"),
    ("train.py model.predictor._target_=shutil.copyfile", "names code"),
    ("evaluate.py --config-dir=/tmp/elsewhere", "names code or configs from elsewhere"),
    ("evaluate.py hydra.searchpath=[file:///tmp]", "names code or configs from elsewhere"),
])
def test_a_plan_naming_code_runs_nothing(tmp_path, command, reason):
    from serving_integration.experiments import results

    marker = tmp_path / "marker"
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({"steps": [{"name": "x", "kind": "data", "command": command.replace("MARKER", str(marker))}]}))
    with pytest.raises(ValueError) as e:
        results.run_steps(results.load_plan(plan), tmp_path / "runs")
    assert reason in str(e.value) and str(plan) in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_the_committed_plan_is_values_only():
    from serving_integration.experiments.results import load_plan

    assert len(load_plan(CONF_DIR / "results.yaml")) > 10


# -------------------------------------------------------------------- loaders: all or nothing, bounded


def imported(capsys, src, out, fmt):
    """import_traces' exit status and its stderr (no traceback)."""
    from data import import_traces

    status = import_traces.main([f"format={fmt}", f"src={src}", f"out={out}"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


@pytest.fixture
def who_and_when_copy(tmp_path):
    from tests.conftest import WHO_AND_WHEN

    src = tmp_path / "who_and_when"
    for subset in ("Algorithm-Generated", "Hand-Crafted"):
        (src / subset).mkdir(parents=True)
        for path in sorted((WHO_AND_WHEN / subset).glob("*.json*"))[:3]:
            shutil.copy(path, src / subset / path.name)
    return src


def test_an_unreadable_subset_fails_the_whole_import(who_and_when_copy, tmp_path, capsys, monkeypatch):
    """Permission denied on one subset folder, then on one run file (raised where the system call
    is, so that the test also holds when run as root, who reads anything)."""
    import data.formats
    import data.who_and_when

    subset = who_and_when_copy / "Hand-Crafted"
    one_file = sorted((who_and_when_copy / "Algorithm-Generated").iterdir())[1]

    def denied(real, path):
        def call(*args, **kwargs):
            if Path(args[0]) == path:
                raise PermissionError(13, "Permission denied", str(path))
            return real(*args, **kwargs)
        return call
    monkeypatch.setattr(data.who_and_when.os, "scandir", denied(os.scandir, subset))
    status, err = imported(capsys, who_and_when_copy, tmp_path / "out", "who_and_when")
    assert status == 1 and f"{subset}: cannot read this subset: Permission denied" in err
    monkeypatch.undo()
    monkeypatch.setattr(data.formats.os, "open", denied(os.open, one_file))
    status, err = imported(capsys, who_and_when_copy, tmp_path / "out", "who_and_when")
    assert status == 1 and f"{one_file}: cannot read: Permission denied" in err
    assert not (tmp_path / "out").exists()


def test_a_subset_that_links_to_itself_is_refused(who_and_when_copy, tmp_path, capsys):
    shutil.rmtree(who_and_when_copy / "Hand-Crafted")
    (who_and_when_copy / "Hand-Crafted").symlink_to(who_and_when_copy / "Hand-Crafted")
    status, err = imported(capsys, who_and_when_copy, tmp_path / "out", "who_and_when")
    assert status == 1 and f"{who_and_when_copy / 'Hand-Crafted'}: cannot read this subset" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "socket", "symlink loop"])
def test_a_source_that_is_not_a_regular_file_is_refused(tmp_path, capsys, kind):
    import socket

    src = tmp_path / "src.jsonl"
    if kind == "fifo":
        os.mkfifo(src)  # no writer: reading it would block forever
    elif kind == "device":
        src = Path("/dev/zero")  # never ends
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(src))
    else:
        src.symlink_to(src)
    status, err = imported(capsys, src, tmp_path / "out", "chat")
    assert status in (1, 2) and str(src) in err, err
    assert {"fifo": ["is a FIFO"], "device": ["is a device"], "socket": ["is a socket", "No such device"],
            "symlink loop": ["no such file"]}[kind][-1] in err  # a loop never resolves: the config check refuses it
    assert not (tmp_path / "out").exists()


def test_json_nested_beyond_the_recursion_limit_is_an_issue(tmp_path, capsys):
    src = tmp_path / "tau.json"
    src.write_text("[" * 100_000 + "]" * 100_000)
    status, err = imported(capsys, src, tmp_path / "out", "tau_bench")
    assert status == 1 and f"{src}: JSON nested deeper than Python's recursion limit" in err
    chat = tmp_path / "chat.jsonl"
    chat.write_text(chat_line(extra="DEEP").replace('"DEEP"', "[" * 100_000 + "]" * 100_000) + "\n")
    status, err = imported(capsys, chat, tmp_path / "out", "chat")
    assert status == 1 and f"{chat}:1:" in err and "recursion limit exceeded" in err
    assert not (tmp_path / "out").exists()


def test_chat_lines_where_only_some_carry_a_step_are_refused(tmp_path, capsys):
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join([chat_line(step=5), chat_line(), chat_line()]) + "\n")
    status, err = imported(capsys, src, tmp_path / "out", "chat")
    assert status == 1 and f"{src}:2: field 'step': workflow 't1' gives a step on some lines" in err
    assert not (tmp_path / "out").exists()
    src.write_text("\n".join([chat_line(step=5), chat_line(step=1), chat_line(step=2)]) + "\n")
    assert imported(capsys, src, tmp_path / "out", "chat")[0] == 0  # all given: ordered by step
    assert [r["step"] for r in store.load(tmp_path / "out").rows()] == [1, 2, 5]


# -------------------------------------------------------------------- a kill at every rename keeps an output


def killed_at_every_rename(command, state):
    """Run `command` (tests.entry.killpoints) killed before its 1st, 2nd, ... rename until it completes;
    after each kill `state()` must find a complete output (it returns which one). Returns the
    states seen, the last one the completed run's."""
    import subprocess
    import sys

    from tests.entry.killpoints import KILLED

    seen, kill_at = [], 1
    while True:
        done = subprocess.run([sys.executable, "-m", "tests.entry.killpoints", str(kill_at), *map(str, command)],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        seen.append(state())
        if done.returncode != KILLED:
            assert done.returncode == 0, done.stderr[-2000:]
            return seen
        kill_at += 1


def siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


@pytest.mark.slow  # one child process per rename
def test_data_generate_killed_at_every_rename_keeps_the_old_or_the_new_dataset(tmp_path):
    out = tmp_path / "ds"
    args = ["-m", "data.generate", "workload=hover", "seed=0", f"out={out}", "overwrite=true",
            "workload.passage_tokens=24"]
    killed_at_every_rename([*args, "n_workflows=5"], lambda: None)
    seen = killed_at_every_rename([*args, "n_workflows=6"], lambda: store.load(out).n_workflows)
    assert set(seen[:-1]) <= {5, 6} and seen[0] == 5 and seen[-1] == 6 and len(seen) >= 2
    assert siblings(out) == []  # the completed run cleaned what the killed ones left


@pytest.mark.slow  # one child process per rename
def test_train_killed_at_every_rename_keeps_one_whole_run(tmp_path):
    """The run folder's config, checkpoint and metrics are always of one run (seed 0 or seed 1)."""
    from models import read_checkpoint

    run = tmp_path / "run"
    args = ["train.py", "debug=train", "model=markov", f"hydra.run.dir={run}",
            f"data.cache_dir={tmp_path / 'cache'}", "data.source.n_workflows=20"]

    def state():
        config = OmegaConf.load(run / ".hydra" / "config.yaml")
        checkpoint = read_checkpoint(run / "predictor.pt")
        metrics = json.loads((run / "metrics.json").read_text())
        assert checkpoint["config"]["seed"] == config.seed and Path(metrics["checkpoint"]) == run / "predictor.pt"
        assert (run / "train.log").is_file()
        return config.seed
    killed_at_every_rename([*args, "seed=0"], lambda: None)
    seen = killed_at_every_rename([*args, "seed=1"], state)
    assert seen[0] == 0 and seen[-1] == 1 and set(seen) == {0, 1}
    assert siblings(run) == []


@pytest.mark.slow  # one child process per rename
def test_evaluate_killed_at_every_rename_never_mixes_two_runs(tmp_path):
    run = tmp_path / "run"
    args = ["evaluate.py", "debug=evaluate", "policies=[lru]", "prefetch=[none]", f"hydra.run.dir={run}",
            f"data.cache_dir={tmp_path / 'cache'}", "data.source.n_workflows=12"]
    plots = {}

    def state():
        summary = json.loads((run / "summary.json").read_text())
        gpu = summary["config"]["sim"]["gpu_tokens"]
        assert OmegaConf.load(run / ".hydra" / "config.yaml").sim.gpu_tokens == gpu
        images = {name: (run / name).read_bytes() for name in ("hit_rate.png", "latency.png")}
        assert plots.setdefault(gpu, images) == images  # the PNGs are this summary's
        return gpu
    killed_at_every_rename([*args, "sim.gpu_tokens=40000"], lambda: None)
    seen = killed_at_every_rename([*args, "sim.gpu_tokens=80000"], state)
    assert seen[0] == 40000 and seen[-1] == 80000
    assert siblings(run) == []


@pytest.mark.slow  # one child process per rename
def test_report_and_results_killed_at_every_rename_keep_a_whole_output(tmp_path):
    import evaluate as evaluate_py
    from data.cli import compose_config

    runs = tmp_path / "runs"
    for name, gpu in (("a", 40000), ("b", 80000)):
        cfg = compose_config("evaluate", [f"data.cache_dir={tmp_path / 'cache'}", "data.source.n_workflows=12",
                                          "split=all", "policies=[lru]", "prefetch=[none]", "wandb.enabled=false",
                                          f"sim.gpu_tokens={gpu}", "sim.concurrency=4"])
        evaluate_py.run(cfg, runs / "evaluate" / name)
    out = tmp_path / "report"
    report = ["-m", "serving_integration.experiments.report", f"out={out}"]
    killed_at_every_rename([*report, f"runs=[{runs / 'evaluate' / 'a'}]"], lambda: None)
    text = lambda: (out / "report.md").read_text().count("| lru")  # noqa: E731
    before = text()
    seen = killed_at_every_rename([*report, f"runs=[{runs / 'evaluate' / 'a'},{runs / 'evaluate' / 'b'}]"],
                                  lambda: (text(), (out / MARKER).is_file()))
    assert seen[0] == (before, True) and seen[-1][0] > before and all(marked for _, marked in seen)
    assert siblings(out) == []

    plan, page = tmp_path / "plan.yaml", tmp_path / "results.md"
    (runs / "steps.json").write_text(json.dumps({}))
    results = ["-m", "serving_integration.experiments.results", f"plan={plan}", f"runs={runs}", f"out={page}",
               "render_only=true"]
    step = {"name": "a", "kind": "evaluate", "title": "A", "command": "evaluate.py"}
    plan.write_text(json.dumps({"steps": [step]}))
    killed_at_every_rename(results, lambda: None)
    old = page.read_text()
    plan.write_text(json.dumps({"steps": [step, {**step, "name": "b", "title": "B"}]}))
    seen = killed_at_every_rename(results, lambda: page.read_text())
    new = page.read_text()
    assert new != old and set(seen) <= {old, new} and seen[0] == old
    assert siblings(page) == []


# -------------------------------------------------------------------- outputs only where the command may write


def listing(root):
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


def compose_train(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_a_run_dir_holding_what_the_command_did_not_write_is_refused(tmp_path, capsys, monkeypatch, entry):
    import evaluate
    import train

    module = {"train": train, "evaluate": evaluate}[entry]
    cfg = (compose_train if entry == "train" else compose_evaluate)([f"data.cache_dir={tmp_path / 'cache'}"])
    work = {"train": "models.training.train", "evaluate": "evaluate.evaluate"}[entry]
    monkeypatch.setattr(work, lambda *a, **k: pytest.fail("the work ran"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for run_dir, message in ((mine, "did not make (it has no .pbkv-output marker)"),
                             (REPO, "is or holds the repository root"), (REPO.parent, "is or holds the repository root")):
        assert run_reported(module.run, cfg, run_dir) == 1
        assert message in one_line(capsys)
    assert listing(mine) == ["thesis.tex"]


@pytest.mark.parametrize("name", ["metrics.json", "../../escaped.pt", "sub/predictor.pt", ".hidden.pt", "x.pt/"])
def test_checkpoint_name_is_a_file_name(tmp_path, capsys, name):
    import train

    cfg = compose_train([f"checkpoint_name={name}", f"data.cache_dir={tmp_path / 'cache'}"])
    status = run_reported(train.run, cfg, tmp_path / "run")
    assert status == 2 and f"checkpoint_name={name}: should be a file name ending in .pt" in one_line(capsys)
    assert listing(tmp_path) == []


@pytest.mark.slow
def test_a_run_dir_on_the_input_dataset_is_refused_before_hydra_writes(dataset, tmp_path):
    """Through the real entry point: Hydra writes no .hydra/ and no log into the dataset."""
    import subprocess
    import sys

    before = listing(dataset)
    done = subprocess.run([sys.executable, "evaluate.py", f"data.path={dataset}", f"hydra.run.dir={dataset}",
                           "policies=[lru]", "wandb=disabled"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and f"output {dataset} is also an input" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert listing(dataset) == before


def test_argparse_commands_never_write_over_their_inputs(dataset, tmp_path, capsys):
    from serving_integration.experiments import calibrate, results, validate_sim

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "summary.json").write_text(json.dumps({"real": []}))
    for out, message in ((dataset, "is also an input"), (earlier, "holds the input")):
        assert validate_sim.main(["--data", str(dataset), "--real-from", str(earlier / "summary.json"),
                                  "--out", str(out)]) == 1
        assert message in one_line(capsys)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("{}\n")
    assert calibrate.main(["--calls", str(calls), "--out", str(calls)]) == 2
    assert "is also an input" in one_line(capsys)
    assert calibrate.main(["--calls", str(calls), "--name", "../../x"]) == 2
    assert "--name ../../x: a preset name" in one_line(capsys)
    plan, runs = tmp_path / "plan.yaml", tmp_path / "runs"
    plan.write_text(json.dumps({"steps": []}))
    runs.mkdir()
    (runs / "steps.json").write_text("{}")
    for out in (plan, runs / "steps.json"):
        assert results.main([f"plan={plan}", f"runs={runs}", f"out={out}", "render_only=true"]) == 1
        assert "is also an input" in one_line(capsys)
    assert calls.read_text() == "{}\n" and plan.read_text() == '{"steps": []}' and (runs / "steps.json").read_text() == "{}"
    assert listing(earlier) == ["summary.json"] and not (REPO / "x.yaml").exists()
