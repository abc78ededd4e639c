"""The results page is built by running a plan of commands and rendering what they wrote."""

import json

import pytest
import yaml

from serving_integration.experiments import results


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
    assert results.main(["--plan", str(plan), "--runs", str(tmp_path / "runs"), "--out", str(out)]) == 0
    page = out.read_text()
    record = json.loads((tmp_path / "runs" / "steps.json").read_text())
    assert set(record) == {"hover", "small"} and all(r["wall_s"] > 0 for r in record.values())
    assert "| hover | 30 |" in page  # the dataset row, from its meta.json
    assert "python evaluate.py debug=evaluate policies=[lru,pbkv_lae]" in page
    assert "python evaluate.py debug=evaluate policies=[lru] sim.gpu_tokens=60000" in page  # each command named
    for run in ("a", "b"):  # one report over both runs of the step
        rows = json.loads((tmp_path / "runs" / "evaluate" / "small" / run / "summary.json").read_text())["rows"]
        lru = next(r for r in rows if r["policy"] == "lru")
        assert f"{lru['hit_rate']:.1%}" in page  # numbers come from the run's rows
    # rendering again from the same runs gives the same page (no run needed)
    before = page
    assert results.main(["--plan", str(plan), "--runs", str(tmp_path / "runs"), "--out", str(out), "--render-only"]) == 0
    assert out.read_text() == before


def test_a_plan_step_needs_commands(tmp_path):
    plan = tmp_path / "plan.yaml"
    for command in (["evaluate.py", ""], [], None, 3):
        plan.write_text(yaml.safe_dump({"steps": [{"name": "x", "kind": "evaluate", "command": command}]}))
        with pytest.raises(ValueError, match="a list of commands"):
            results.load_plan(plan)


def test_a_server_step_inlines_its_report(tmp_path):
    """kind: server (validate_sim on real servers): the page shows the run's report.md under its command."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"steps": [
        {"name": "check", "kind": "server", "title": "Real against simulated", "about": "Ten workflows.",
         "command": "-m serving_integration.experiments.report --help"}]}))  # a plan runs project commands only
    runs = tmp_path / "runs"
    (runs / "server" / "check").mkdir(parents=True)
    (runs / "server" / "check" / "report.md").write_text("lru | 16.0% / 14.7%\n")
    out = tmp_path / "results.md"
    assert results.main(["--plan", str(plan), "--runs", str(runs), "--out", str(out)]) == 0
    page = out.read_text()
    assert "### Real against simulated" in page and "lru | 16.0% / 14.7%" in page
    # the command comes before its numbers
    assert page.index("python -m serving_integration.experiments.report") < page.index("lru | 16.0%")
