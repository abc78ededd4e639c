"""The results pages are built by running a plan of commands and rendering what they wrote: an index
(headline table, claims, real servers, one plot per experiment) and a detail page per experiment."""

import json
from pathlib import Path

import pytest
import yaml

from serving_integration.experiments import results


@pytest.mark.slow
def test_plan_runs_and_page_names_its_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("PBKV_DATA_CACHE", str(tmp_path / "cache"))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"steps": [
        {"name": "hover", "kind": "data", "command": "-m data.generate workload=hover n_workflows=30 out=RUNS/data/hover"},
        {"name": "small", "kind": "evaluate", "title": "A small run", "about": "Two policies, two commands.",
         "command": ["evaluate.py debug=evaluate policies=[lru,pbkv_lae] hydra.run.dir=RUNS/evaluate/small/a",
                     "evaluate.py debug=evaluate policies=[lru] sim.gpu_tokens=60000 hydra.run.dir=RUNS/evaluate/small/b"]},
    ]}))
    out = tmp_path / "docs" / "results.md"
    (tmp_path / "README.md").write_text(f"intro\n{results.README_BEGIN}\nold\n{results.README_END}\nrest\n")
    argv = [f"plan={plan}", f"runs={tmp_path / 'runs'}", f"out={out}"]
    assert results.main(argv) == 0
    page, detail = out.read_text(), (tmp_path / "docs" / "results" / "small.md").read_text()
    record = json.loads((tmp_path / "runs" / "steps.json").read_text())
    assert set(record) == {"hover", "small"} and all(r["wall_s"] > 0 for r in record.values())
    assert "| hover | 30 |" in (tmp_path / "docs" / "results" / "datasets.md").read_text()  # from its meta.json
    assert "python evaluate.py debug=evaluate policies=[lru,pbkv_lae]" in detail
    assert "python evaluate.py debug=evaluate policies=[lru] sim.gpu_tokens=60000" in detail  # each command named
    for run in ("a", "b"):  # one detail page over both runs of the step
        rows = json.loads((tmp_path / "runs" / "evaluate" / "small" / run / "summary.json").read_text())["rows"]
        lru = next(r for r in rows if r["policy"] == "lru")
        assert f"{lru['hit_rate']:.1%}" in detail  # numbers come from the run's rows
    # the index: short, its plot links the detail page, whose plots exist
    assert len(page.splitlines()) <= 150 and "(results/small.md)" in page
    plot = next(line for line in page.splitlines() if line.startswith("!["))
    assert (out.parent / plot.split("](", 1)[1].rstrip(")")).is_file()
    assert (tmp_path / "docs" / "pipeline.png").stat().st_size > 10_000
    assert (tmp_path / "README.md").read_text().startswith(f"intro\n{results.README_BEGIN}\n")  # no pbkv: kept
    # rendering again from the same runs gives the same pages (no run needed)
    before = page, detail
    assert results.main([*argv, "render_only=true"]) == 0
    assert (out.read_text(), (tmp_path / "docs" / "results" / "small.md").read_text()) == before


def test_a_plan_step_needs_commands(tmp_path):
    plan = tmp_path / "plan.yaml"
    for command in (["evaluate.py", ""], [], None, 3):
        plan.write_text(yaml.safe_dump({"steps": [{"name": "x", "kind": "evaluate", "command": command}]}))
        with pytest.raises(ValueError, match="a list of commands"):
            results.load_plan(plan)


def test_a_server_step_inlines_its_report(tmp_path):
    """kind: server (validate_sim on real servers): the page shows each command's report.md (from its
    --out) under the commands; the index shows the first one's table and checks."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"steps": [
        {"name": "check", "kind": "server", "title": "Real against simulated", "about": "Ten workflows.",
         # a plan runs project commands only
         "command": ["-m benchmarks.predictor_table --help --out RUNS/server/check",
                     "-m benchmarks.predictor_table --help --out RUNS/server/check_partial"]}]}))
    runs = tmp_path / "runs"
    for name, hits in (("check", "16.0% / 14.7%"), ("check_partial", "19.0% / 18.1%")):
        (runs / "server" / name).mkdir(parents=True)
        (runs / "server" / name / "report.md").write_text(f"replayed {name}\n\npolicy | hit real / sim\n--- | ---\n"
                                                          f"lru | {hits}\norder by device hit rate: lru\n")
    out = tmp_path / "results.md"
    assert results.main([f"plan={plan}", f"runs={runs}", f"out={out}"]) == 0
    page, detail = out.read_text(), (tmp_path / "results" / "check.md").read_text()
    assert "### Real against simulated" in page and "lru | 16.0% / 14.7%" in page and "(results/check.md)" in page
    assert "19.0%" not in page and "Checks: order by device hit rate: lru." in page
    assert detail.index("python -m benchmarks.predictor_table") < detail.index("lru | 16.0%") < detail.index("19.0%")


def test_a_step_without_runs_here_keeps_its_last_page(tmp_path):
    """Runs are not committed: a page rendered from runs another machine had is kept (and says so),
    its plot and its server table stay on the index, and so do the headline and the claims, which
    the rows here would only partly make; its step time still counts; a step that never ran reads
    "Not run yet"."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"steps": [
        {"name": "check", "kind": "server", "title": "Real against simulated", "command": "-m benchmarks.predictor_table"},
        {"name": "swept", "kind": "evaluate", "title": "A sweep", "command": "evaluate.py hydra.run.dir=RUNS/evaluate/swept"},
        {"name": "never", "kind": "evaluate", "title": "Never run", "command": "evaluate.py hydra.run.dir=RUNS/evaluate/never"}]}))
    runs, out = tmp_path / "runs", tmp_path / "docs" / "results.md"
    (runs / "server" / "check").mkdir(parents=True)
    (runs / "server" / "check" / "report.md").write_text("policy | hit real / sim\n--- | ---\nlru | 16.0% / 14.7%\n")
    (runs / "steps.json").write_text(json.dumps({"check": {"command": "python -m benchmarks.predictor_table",
                                                           "wall_s": 300.0, "finished": "2026-11-30 10:00 UTC"},
                                                 # a step the plan no longer has: its time is not the plan's
                                                 "gone": {"command": "python evaluate.py", "wall_s": 6000.0,
                                                          "finished": "2026-11-29 10:00 UTC"}}))
    pages = out.parent / "results"
    pages.mkdir(parents=True)
    (pages / "swept.md").write_text("# A sweep\n\n[Back](../results.md)\n\nMade by:\n\n    python evaluate.py "
                                    "hydra.run.dir=RUNS/evaluate/swept    # 600.0 s, 2026-11-30 10:00 UTC\n\n"
                                    "![hit rate](swept/hit_rate.png)\n")
    out.write_text(f"# Results\n\n{results.HEADLINE}\n\nold headline\n\n{results.CLAIMS}\n\nold claims\n")
    (pages / "never.md").write_text("# Never run\n\n[Back](../results.md)\n\nNot run yet.\n\n    python evaluate.py    "
                                    "# ? s, not run\n")
    argv = [f"plan={plan}", f"runs={runs}", f"out={out}", "render_only=true"]
    assert results.main(argv) == 0
    assert "(15 min of step time, the kept pages' steps as they last ran)" in out.read_text()
    (runs / "server" / "check" / "report.md").unlink()  # another machine: the server's run is gone too
    (runs / "steps.json").write_text("{}")
    for _ in range(2):  # marked once, however often it is kept
        assert results.main(argv) == 0
        swept, check, index = ((pages / "swept.md").read_text(), (pages / "check.md").read_text(), out.read_text())
        assert swept.count(results.KEPT) == 1 and "# 600.0 s, 2026-11-30" in swept
        assert "old headline" in index and "old claims" in index  # swept's rows are not here to make them
        assert "(15 min of step time, the kept pages' steps as they last ran)" in index
        assert check.count(results.KEPT) == 1 and "lru | 16.0% / 14.7%" in check
        assert "![hit rate](results/swept/hit_rate.png)" in index and "lru | 16.0% / 14.7%" in index
        assert "Kept as last rendered, their runs not in that folder: check, swept" in index
        assert "Not run yet." in (pages / "never.md").read_text() and results.KEPT not in (pages / "never.md").read_text()


def test_a_bad_setting_is_exit_2(tmp_path, capsys):
    assert results.main(["only=[nowhere]", f"runs={tmp_path}", f"out={tmp_path / 'r.md'}"]) == 2
    assert "only=[nowhere]: nowhere is not a step of" in capsys.readouterr().err
    assert results.main(["render_only=maybe"]) == 2


def test_the_headline_goes_into_the_readme_between_its_marks():
    readme = f"top\n{results.README_BEGIN}\n| old |\n{results.README_END}\nbottom\n"
    assert results.readme_with_headline(readme, "| new |") == (
        f"top\n{results.README_BEGIN}\n| new |\n{results.README_END}\nbottom\n")
    assert results.readme_with_headline("no marks\n", "| new |") == "no marks\n"


def test_the_datasets_page_shows_what_each_datasets_prompts_resend(tmp_path):
    """A transcript-memory variant sits beside its default dataset, with its memory and its (higher)
    reusable share; imported traces are as recorded."""
    from data import store
    from data.generators import Hover

    real = Hover().generate(3, seed=1)
    real.meta = {**real.meta, "format": "who_and_when"}  # an imported trace set, as the page tells them apart
    for name, traces in (("hover", Hover().generate(20, seed=0)),
                         ("hover_transcript", Hover(memory="transcript").generate(20, seed=0)), ("real", real)):
        store.save(store.build(traces), tmp_path / "data" / name)
    steps = [{"name": n, "kind": "data", "command": f"-m data.generate out=RUNS/data/{n}"}
             for n in ("hover", "hover_transcript", "real")]
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")
            for line in results.dataset_page(steps, tmp_path, {}).splitlines() if line.startswith("| ")}
    assert rows["dataset"][-2:] == ["memory", "reusable share"]
    assert rows["hover"][-2] == "per agent" and rows["hover_transcript"][-2] == "transcript"
    assert rows["real"][-2] == "as recorded"
    share = {n: float(rows[n][-1].rstrip("%")) for n in ("hover", "hover_transcript")}
    assert share["hover_transcript"] > share["hover"] + 30


def test_a_plan_step_that_sweeps_on_its_command_line_says_multirun():
    """Hydra parses `key=a,b` as a sweep only with -m (an experiment's `hydra.mode: MULTIRUN` comes
    too late for the parser: "Ambiguous value", and the step does not run). Checked on every step of
    the shipped plan."""
    import re
    import shlex

    from data import REPO

    def sweeps(value: str) -> bool:  # a comma outside brackets and quotes
        depth = 0
        for ch in re.sub(r"'[^']*'|\"[^\"]*\"", "", value):
            if ch in "[{(":
                depth += 1
            elif ch in "]})":
                depth -= 1
            if ch == "," and depth == 0:
                return True
        return False

    for step in results.load_plan(REPO / "conf" / "results.yaml"):
        for command in results.step_commands(step):
            words = shlex.split(command)
            if words[0] not in ("evaluate.py", "train.py"):
                continue
            swept = [w for w in words if "=" in w and sweeps(w.split("=", 1)[1])]
            assert not swept or {"-m", "--multirun"} & set(words), (step["name"], swept)


def test_the_committed_pages_stay_short():
    """The README is a guide (at most 200 lines) and the results index an index (at most 150)."""
    repo = Path(__file__).resolve().parents[2]
    assert len((repo / "docs" / "results.md").read_text().splitlines()) <= 150
    assert len((repo / "README.md").read_text().splitlines()) <= 200
