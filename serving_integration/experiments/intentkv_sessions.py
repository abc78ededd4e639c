"""The prefix-cache hit rate of sessions pruned by the IntentKV trainer, replayed in the simulator
(docs/intentkv.md).

    python -m serving_integration.experiments.intentkv_sessions runs/intentkv [docs/intentkv.md]

reads ``RUN/keep_masks.pt`` (written by ``python -m models.intentkv.train``: every method's kept
tokens at each budget on the held-out sessions of repeat 0, with each decision point's context
length, system prefix and output length) and writes ``RUN/prefix_hits.json``: one row per method,
budget and layout, as evaluate.py's KV-pruning rows (``comparison: kv``; serving_integration/
experiments/intentkv_replay.py), plus the unpruned replay (layout ``none``). It then renders the
results section (``RUN/report.md``: the recall table with intervals, the paired comparisons, the
prefix-hit rows through the report's own KV table, and the paper's numbers beside ours) and, given
a page, replaces the part of it between ``<!-- intentkv-results:begin -->`` and ``<!-- intentkv-results:end -->``.

Each held-out session is one workflow, each decision point one call whose prompt is the context
before the tool call and whose output is the call's message. Units are single tokens (ids by
position; the system prefix's ids are shared by every session when all sessions start with the
same system prompt, as tau-bench's do), so the radix-tree match is exact:

- compaction: the prompt is the kept tokens, renumbered; a later call reuses cache only as far as
  its kept sequence equals an earlier one from the start;
- sentinel: the prompt is the full token sequence with the dropped positions holding no KV
  (0 tokens); a position dropped when its call computed it stays without KV for the rest of the
  session (it cannot be kept again, as in the simulator's own KV rows).

The generated tool-call tokens are matched as prompt tokens of the later calls, not as the
decoded KV of the call that wrote them (a few dozen tokens per call). The simulator runs with its
default sizes (conf/sim) and cost model (conf/cost_model/qwen3-14b-h100.yaml), LRU eviction.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from data import REPO
from data.atomic import write_json
from serving_integration.cache.workload import SimCall, SimWorkflow, prefix_keys

COST_MODEL = REPO / "conf" / "cost_model" / "qwen3-14b-h100.yaml"
LAYOUTS = ("compaction", "sentinel")


def _unit(session: str, pos: int, system_end: int, shared: bool) -> str:
    return f"system:{pos}" if shared and pos < system_end else f"{session}:{pos}"


def session_workflows(masks: dict, method: str, share: str, layout: str,
                      after_system: bool = False) -> list[SimWorkflow]:
    """The held-out sessions as workflows, each call's prompt pruned by ``method``'s kept tokens at
    budget ``share`` in ``layout`` (``none``: unpruned); ``after_system``: the prompts without the
    system prefix (which every layout keeps and every session shares), so that the hit rate is
    that of the history alone."""
    decisions = masks["decisions"]
    shared = masks.get("system_prefix_shared", False)
    keeps = masks[method][share] if layout != "none" else [None] * len(decisions)
    by_session: dict[str, list] = {}
    for d, keep in zip(decisions, keeps):
        by_session.setdefault(d["session"], []).append((d, keep))
    workflows = []
    for order, (session, calls) in enumerate(by_session.items()):
        gone = torch.zeros(0, dtype=torch.bool)   # sentinel: positions computed without KV
        sim_calls = []
        for d, keep in calls:
            end = d["end"]
            keep = torch.ones(end, dtype=torch.bool) if keep is None else keep.clone()
            if layout == "sentinel":
                keep[: gone.numel()] &= ~gone
                gone = torch.cat([gone, ~keep[gone.numel():]])
            units = [_unit(session, p, d["system_end"], shared) for p in range(end)]
            if after_system:
                units, keep = units[d["system_end"]:], keep[d["system_end"]:]
            if layout == "compaction":
                units = [u for u, k in zip(units, keep.tolist()) if k]
                lens = (1,) * len(units)
            else:
                lens = tuple(int(k) for k in keep.tolist())
            sim_calls.append(SimCall(agent="agent", units=tuple(units), lens=lens, keys=prefix_keys(units),
                                     output_unit=f"{session}:output{d['call']}", output_tokens=d["output_tokens"],
                                     tool_time=1.0, hidden=None))
        workflows.append(SimWorkflow(session, order, "", sim_calls))
    return workflows


def replay_rows(masks: dict, workload: str) -> list[dict]:
    """The unpruned replay and one row per method, budget and layout: of the whole prompts, then of
    the prompts after the system prefix (workload label ``... (after the system prompt)``)."""
    from serving_integration.experiments.evaluation import Setting
    from serving_integration.simulator.config import SimConfig, cost_model_preset

    setting = Setting(SimConfig(), cost_model_preset(COST_MODEL), workload=workload, seed=0, split="test")
    runs = [("none", "none", None)] + [(layout, method, share) for method in masks["methods"]
                                       for share in masks["budgets"] for layout in LAYOUTS]
    rows = []
    for after_system in (False, True):
        setting.labels["workload"] = f"{workload} (after the system prompt)" if after_system else workload
        for layout, method, share in runs:
            workflows = session_workflows(masks, method, share, layout, after_system)
            rows.append(setting.run(workflows, "lru", "none", {"policy": "lru"}, comparison="kv", layout=layout,
                                    kv_method=method, kv_budget=None if share is None else f"{float(share):.0%}"))
    return rows


BEGIN, END = "<!-- intentkv-results:begin -->", "<!-- intentkv-results:end -->"
# arXiv 2606.09916's prefix-cache hit rates: sentinel slots in its two settings, and compaction's range
PAPER_SENTINEL, PAPER_COMPACTION = ("20.7%", "26.0%"), "0-3%"
HEAD = "intent_rule+residual"


def peak_reduction(masks: dict, method: str, share: str) -> float:
    """Mean over sessions of 1 - (most tokens kept at once) / (longest unpruned context)."""
    peaks: dict[str, list[int]] = {}
    for d, keep in zip(masks["decisions"], masks[method][share]):
        peaks.setdefault(d["session"], [0, 0])
        peaks[d["session"]][0] = max(peaks[d["session"]][0], int(keep.sum()))
        peaks[d["session"]][1] = max(peaks[d["session"]][1], d["end"])
    return sum(1 - kept / full for kept, full in peaks.values()) / len(peaks)


def _iv(m: dict, spec: str = "{:.3f}") -> str:
    return f"{spec.format(m['mean'])} [{spec.format(m['low'])}, {spec.format(m['high'])}]"


def render(metrics: dict, masks: dict, rows: list[dict], command: str) -> str:
    from serving_integration.experiments.report import kv_table, md_table

    cfg, summary = metrics["config"], metrics["summary"]
    cols = ["auroc", *[f"recall@{float(b):g}" for b in masks["budgets"]]]
    recall = md_table(["method", "AUROC", *[f"recall@{float(b):.0%}" for b in masks["budgets"]]],
                      [[name, *[_iv(m[c]) for c in cols]] for name, m in summary.items()])
    comparisons = md_table(["comparison", "metric", "difference [95% CI]", "verdict"],
                           [[pair.split(": ")[0], pair.split(": ")[1], _iv(c, "{:+.3f}"), c["verdict"]]
                            for pair, c in metrics["comparisons"].items()])
    hit = {(r["workload"], r["layout"], r["kv_method"], r["kv_budget"]): r["reuse_rate"] for r in rows}
    budget = masks["budgets"][len(masks["budgets"]) // 2]
    label = f"{float(budget):.0%}"
    history = f"{cfg['sessions']} (after the system prompt)"
    ours = [f"{hit[(cfg['sessions'], layout, HEAD, label)]:.1%} (after the system prompt: "
            f"{hit[(history, layout, HEAD, label)]:.1%})" for layout in ("sentinel", "compaction")]
    ablation = metrics["comparisons"].get(f"intent_rule vs current_query: recall@{float(budget):g}")
    splits = metrics["splits"][0]
    paper = md_table(["", "arXiv 2606.09916", f"ours ({cfg['sessions']}, held-out, budget {label})"], [
        ["prefix-cache hit rate, sentinel slots", " / ".join(PAPER_SENTINEL), ours[0]],
        ["prefix-cache hit rate, compaction", PAPER_COMPACTION, ours[1]],
        ["peak-token reduction (rule + head)", "see the paper",
         f"{peak_reduction(masks, HEAD, budget):.1%}"],
        ["memory vs current query only (rule, recall)", "see the paper",
         f"{ablation['mean']:+.3f} [{ablation['low']:+.3f}, {ablation['high']:+.3f}]: {ablation['verdict']}"
         if ablation else "n/a"],
        ["model whose Q/K score", "the causal serving LLM (Qwen2.5-14B)",
         "all-MiniLM-L6-v2, a bidirectional 6-layer encoder, windows of "
         f"{cfg['window']} stepping {cfg['stride']}"],
    ])
    return "\n".join([
        BEGIN,
        f"Generated by `{command}` from the trainer's output (`python -m models.intentkv.train "
        f"sessions={cfg['sessions']}" + (f" trials={cfg['trials']}" if cfg["sessions"] == "tau_bench" else "")
        + f" repeats={cfg['repeats']} steps={cfg['steps']}`).",
        "",
        f"{metrics['n_sessions']} sessions, {metrics['n_decisions']} decision points (repeat 0: {splits['train']} "
        f"train / {splits['val']} val / {splits['test']} test), mean context {metrics['mean_context_tokens']:.0f} "
        f"tokens, positive rate {metrics['positive_rate']:.3f}. " + weight_choice(metrics) + " "
        f"Intervals: 95% t-intervals over {cfg['repeats']} repeats "
        f"(seeds {cfg['seed']}..{cfg['seed'] + cfg['repeats'] - 1}: "
        "split, head and sampling each); a comparison is the paired per-repeat difference.",
        "",
        "Held-out decision points (AUROC: mean over decision points; recall: positive tokens kept at the budget, "
        "protected tokens plus the share of the others):",
        "",
        recall,
        "",
        comparisons,
        "",
        "Prefix-cache hit rates of repeat 0's held-out sessions replayed in the simulator (every method, budget "
        "and layout; `none`: unpruned), of the whole prompts and of the prompts after the system prompt (which "
        "every layout keeps and all sessions share, so that it hits under compaction too):",
        "",
        kv_table(rows),
        "",
        "The paper beside ours:",
        "",
        paper,
        END,
    ])


def weight_choice(metrics: dict) -> str:
    cfg, tried = metrics["config"], metrics["rank_weight_validation_auroc"]
    head = f"Loss: BCE (weight {cfg['bce_weight']}) + hard-negative ranking (weight {metrics['rank_weight']}"
    if not tried:
        return head + ", the one weight given)."
    return head + ", the best of " + ", ".join(f"{w} ({a:.3f})" for w, a in tried.items()) + \
        " by validation AUROC of rule + head on repeat 0)."


def write_section(page: Path, section: str) -> None:
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{page}: no {BEGIN} ... {END} section to replace")
    head, rest = text.split(BEGIN, 1)
    page.write_text(head + section + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("usage: python -m serving_integration.experiments.intentkv_sessions RUN_DIR [PAGE]", file=sys.stderr)
        return 2
    run = Path(argv[0])
    for name in ("keep_masks.pt", "metrics.json"):
        if not (run / name).is_file():
            print(f"{run / name}: no such file (run python -m models.intentkv.train out={run} first)", file=sys.stderr)
            return 2
    masks = torch.load(run / "keep_masks.pt", weights_only=True)
    metrics = json.loads((run / "metrics.json").read_text())
    rows = replay_rows(masks, metrics["config"]["sessions"])
    write_json(run / "prefix_hits.json", rows)
    for r in rows:
        print(f"{r['layout']:<11} {r['kv_method']:<22} {str(r['kv_budget']):>5}  prefix hit rate {r['reuse_rate']:.3f}")
    section = render(metrics, masks, rows, "python -m serving_integration.experiments.intentkv_sessions " +
                     " ".join(argv))
    (run / "report.md").write_text(section + "\n")
    if len(argv) == 2:
        try:
            write_section(Path(argv[1]), section)
        except (OSError, ValueError) as e:
            print(e, file=sys.stderr)
            return 2
        print(f"wrote the results section of {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
