"""The results page, docs/results.md, rebuilt from runs (never typed by hand).

    python -m serving_integration.experiments.results                  # run the plan, then write the page
    python -m serving_integration.experiments.results --render-only    # write the page from runs already there
    python -m serving_integration.experiments.results --only memory    # rerun one step, then write the page

The plan (conf/results.yaml) lists steps: datasets to build, predictors to train, evaluate.py
experiments to run. Each step's command and wall time are recorded beside its outputs
(RUNS/steps.json) and printed on the page with its tables, so every number there names the
command that produced it. Evaluate steps go through the report (serving_integration.experiments.report):
the page inlines each step's report.md and keeps its plots under docs/results/.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from data import REPO
from data.atomic import atomic_file, check_command_output, write_json
from serving_integration.experiments.plan_check import check_command

KINDS = ("data", "train", "evaluate", "server")


def load_plan(path: Path) -> list[dict]:
    steps = yaml.safe_load(path.read_text())["steps"]
    for step in steps:
        command = step.get("command")  # one command, or a list run in order (one step's runs under one folder)
        commands_ok = all(isinstance(c, str) and c for c in (command if isinstance(command, list) else [command]))
        if step.get("kind") not in KINDS or not step.get("name") or not command or not commands_ok:
            raise ValueError(f"{path}: step {step!r} needs a name, a kind in {KINDS} and a command "
                             "(or a list of commands)")
        for command in (command if isinstance(command, list) else [command]):
            check_command(command, f"{path}: step {step['name']}")
    return steps


def step_commands(step: dict) -> list[str]:
    return step["command"] if isinstance(step["command"], list) else [step["command"]]


def run_steps(steps: list[dict], runs: Path) -> None:
    """Run each step's commands from the repository root, with RUNS substituted; record wall times."""
    record_file = runs / "steps.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    for step in steps:
        start = time.perf_counter()
        for command in step_commands(step):
            command = command.replace("RUNS", str(runs))
            print(f"== {step['name']}: {command}", flush=True)
            subprocess.run([sys.executable, *shlex.split(command)], cwd=REPO, check=True)
        record[step["name"]] = {"command": "\n".join(f"python {c}" for c in step_commands(step)),
                                "wall_s": round(time.perf_counter() - start, 1),
                                "finished": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        write_json(record_file, record)


def dataset_section(steps: list[dict], runs: Path, record: dict) -> str:
    rows = []
    for step in steps:
        meta = json.loads((runs / "data" / step["name"] / "meta.json").read_text())
        s = meta["stats"]
        cpw, loops, ptok = s["calls_per_workflow"], s["loops_per_workflow"], s["prompt_tokens_per_call"]
        rows.append(f"| {step['name']} | {s['workflows']:,} | {s['agents']} | {cpw['mean']:.2f}, {cpw['max']:.0f} | "
                    f"{loops['mean']:.2f}, {loops['max']:.0f} | {ptok['mean']:,.0f}, {ptok['p50']:,.0f}, "
                    f"{ptok['p99']:,.0f} | {s['output_tokens_per_call']['mean']:,.0f} | {s['reusable_share']:.1%} |")
    head = ("| dataset | workflows | agents | calls/workflow (mean, max) | loops/workflow (mean, max) | "
            "prompt tokens/call (mean, p50, p99) | output tokens/call | reusable share |\n|" + "---|" * 8)
    return "\n\n".join(["## Datasets", "A loop is a call to an agent the workflow already called; the reusable "
                        "share is the share of prompt tokens whose prefix an unbounded prefix cache would hold.",
                        "\n".join([head, *rows]), commands(steps, record)])


def train_section(steps: list[dict], runs: Path, record: dict) -> str:
    from benchmarks.predictor_table import format_table

    parts = ["## Predictors", "Test split, per predicted step k (models/metrics.py): top1 unconditional (steps "
             "past the end count as END), top1_alive over the workflows still running; on generated data the "
             "last row is the Bayes ceiling (docs/predictors.md)."]
    for step in steps:
        parts += [f"### {step['title']}", format_table([runs / "train" / step["name"]], ["top1", "top1_alive"]),
                  commands([step], record)]
    return "\n\n".join(parts)


def evaluate_section(step: dict, runs: Path, record: dict, out: Path) -> str:
    from serving_integration.experiments.report import build

    folder = out.parent / "results" / step["name"]
    report = build([shown(runs / "evaluate" / step["name"])], folder)
    md = report.read_text().split("\n", 1)[1]  # drop the report's own title
    md = md.replace("](", f"](results/{step['name']}/").replace("\n## ", "\n#### ").replace("\n### ", "\n##### ")
    for copy in ("report.html", "report.md"):  # the page inlines the report and links its plots
        (folder / copy).unlink(missing_ok=True)
    return "\n\n".join([f"### {step['title']}", step.get("about", ""), commands([step], record), md])


def server_section(step: dict, runs: Path, record: dict) -> str:
    """A run on real servers (experiments.validate_sim): its report.md, inlined."""
    report = (runs / "server" / step["name"] / "report.md").read_text()
    return "\n\n".join([f"### {step['title']}", step.get("about", ""), commands([step], record), report])


def shown(path: Path) -> str:
    """A path as the page shows it: relative to the repository when inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def commands(steps: list[dict], record: dict) -> str:
    lines = []
    for step in steps:
        done = record.get(step["name"], {})
        planned = "\n".join(f"python {c}" for c in step_commands(step))
        *first, last = done.get("command", planned).split("\n")
        lines += [f"    {c}" for c in first]
        lines.append(f"    {last}    # {done.get('wall_s', '?')} s, {done.get('finished', 'not run')}")
    return "Made by (from the repository root; RUNS is the runs folder):\n\n" + "\n".join(lines)


def render(steps: list[dict], runs: Path, out: Path) -> Path:
    record = json.loads((runs / "steps.json").read_text())
    by_kind = {kind: [s for s in steps if s["kind"] == kind] for kind in KINDS}
    sections = [
        "# Results",
        "Generated by `make results` (`python -m serving_integration.experiments.results`) from the runs in "
        f"`{shown(runs)}`; do not edit by hand. "
        f"Total wall time of the steps: {sum(r['wall_s'] for r in record.values()) / 60:.0f} min on this machine "
        "(2 CPU cores).",
    ]
    if by_kind["data"]:
        sections.append(dataset_section(by_kind["data"], runs, record))
    if by_kind["train"]:
        sections.append(train_section(by_kind["train"], runs, record))
    if by_kind["evaluate"]:
        sections.append("## Cache policies in the simulator")
        sections += [evaluate_section(step, runs, record, out) for step in by_kind["evaluate"]]
    if by_kind["server"]:
        sections.append("## Real SGLang servers on this CPU against the simulator")
        sections += [server_section(step, runs, record) for step in by_kind["server"]]
    with atomic_file(out) as tmp:
        tmp.write_text("\n\n".join(s for s in sections if s) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=REPO / "conf" / "results.yaml")
    parser.add_argument("--runs", type=Path, default=REPO / "runs" / "results")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--only", nargs="+", help="run only these steps (the page is still built from all)")
    parser.add_argument("--render-only", action="store_true", help="run nothing; build the page from the runs")
    args = parser.parse_args(argv)
    runs = args.runs.resolve()
    try:  # the page never replaces what it reads; a plan is checked before any step runs
        check_command_output(args.out, [args.plan, runs / "steps.json"])
        steps = load_plan(args.plan)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.render_only:
        chosen = [s for s in steps if not args.only or s["name"] in args.only]
        run_steps(chosen, runs)
    print(f"results: {render(steps, runs, args.out.resolve())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
