"""How rows look: the one row-label rule (used by evaluate.py, the bench client, the report and the
tests), the printed table, the plots and W&B logging of a run. The row schema: rows.py."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

# a baseline's own prefetch: its rows are compared with it, and its label names only another mode
OWN_PREFETCH = {"kvflow": "kvflow", "kvflow_ideal": "aggressive", "kvflow_nolae": "aggressive",
                "lru_prefetch": "last_call"}


def row_label(r: dict) -> str:
    """The one name of a row in tables, plots and W&B: policy[+prefetch][ (predictor)][ @routing xN], or
    kv/LAYOUT; the routing policy and replica count are named when there is more than one replica.
    The prefetch mode is named where it is a choice (not a baseline's own, OWN_PREFETCH; not 'none'
    except for such a baseline without its prefetch)."""
    if r["comparison"] == "kv":
        return f"kv/{r['layout']}"
    name = r["policy"]
    if r["policy"] in OWN_PREFETCH:
        if r["prefetch"] != OWN_PREFETCH[r["policy"]]:
            name += f"+{r['prefetch']}"
    elif r["prefetch"] != "none":
        name += f"+{r['prefetch']}"
    if r["policy"] in ("pbkv", "pbkv_time") and r.get("predictor") not in (None, "none", "markov"):
        name += f" ({r['predictor']})"
    if r["policy"] in ("pbkv", "pbkv_time") and r.get("predictor") != "perfect" \
            and r.get("trust") in ("always", "accuracy"):
        name += f" [{r['trust']}]"  # always: the paper's policy (pbkv_time's order always); outcome is the default
    if r.get("noise_kind") == "adversarial":
        name += " adversarial"  # the noise level is the row's `noise`
    if r["policy"] == "oracle":  # Belady by distance in calls: a reference, not a bound (rows.py: the bounds)
        name += " (heuristic, Belady)"
    if r.get("replicas", 1) > 1:
        name += f" @{r['routing']} x{r['replicas']}"
    return name


TABLE_COLUMNS = (("policy", "{}"), ("prefetch", "{}"), ("trust", "{}"), ("hit_rate", "{:.1%}"), ("host_hit", "{:.1%}"),
                 ("reuse_rate", "{:.1%}"), ("recompute_rate", "{:.1%}"), ("setting_bound_hit_rate", "{:.1%}"),
                 ("gap_closed", "{:.2f}"), ("setting_bound_recompute_rate", "{:.1%}"),
                 ("gap_closed_recompute", "{:.2f}"),
                 ("mean_workflow_latency_s", "{:.2f}"), ("p99_workflow_latency_s", "{:.2f}"),
                 ("mean_ttft_s", "{:.3f}"), ("throughput_calls_per_s", "{:.2f}"), ("x_lru_hit", "{:.2f}"),
                 ("x_lru_latency", "{:.2f}"), ("time_tool_s", "{:.2f}"), ("time_queue_s", "{:.2f}"),
                 ("time_prefill_s", "{:.2f}"), ("time_decode_s", "{:.2f}"), ("time_pcie_s", "{:.2f}"))
# the table's notes: what the columns that are not plain metrics mean (rows.py add_setting_bounds)
TABLE_NOTES = ("setting_bound_hit_rate: a GPU hit rate that no row of this setting and prefetch class exceeds (the "
               "max over the setting's rows of a bound proven on each row's own request sequence, FOO-style interval "
               "LPs in simulator/bound.py: for rows without prefetch, no eviction policy reaches a higher GPU hit rate "
               "on that sequence; for rows with prefetch, no eviction policy that also prefetches from the host "
               "within the idle PCIe time does); setting_bound_recompute_rate: a share of prompt tokens every policy "
               "recomputes (the min over the rows' sequences, GPU + host capacity); gap_closed = (hit - LRU) / "
               "(bound - LRU); gap_closed_recompute = (LRU - recompute) / (LRU - recompute bound); oracle is a "
               "heuristic (Belady by distance in calls), not a bound; time_*_s: mean seconds per workflow in tool "
               "calls, admission queue, prefill, decode and PCIe loads (they add up to the mean workflow latency)")


def table_rows(rows: list[dict]) -> list[dict]:
    """Rows with the ratios against the run's LRU row (hit rate up, latency speed-up)."""
    base = next((r for r in rows if r["policy"] == "lru"), None)
    out = []
    for r in rows:
        out.append({**r, "host_hit": r["host_hit_tokens"] / r["prompt_tokens"],
                    "x_lru_hit": r["hit_rate"] / base["hit_rate"] if base and base["hit_rate"] else float("nan"),
                    "x_lru_latency": base["mean_workflow_latency_s"] / r["mean_workflow_latency_s"] if base else float("nan")})
    return out


KV_COLUMNS = (("layout", "{}"), ("kv_method", "{}"), ("kv_budget", "{}"), ("reuse_rate", "{:.1%}"),
              ("hit_rate", "{:.1%}"), ("kv_tokens_read", "{:.3g}"), ("mean_workflow_latency_s", "{:.2f}"),
              ("mean_ttft_s", "{:.3f}"))


def format_table(rows: list[dict]) -> str:
    """The policy comparison, then the KV-pruning rows if any."""
    policy_rows = [r for r in rows if r["comparison"] == "policies"]
    kv_rows = [r for r in rows if r["comparison"] == "kv"]
    parts = [_table(table_rows(policy_rows), TABLE_COLUMNS) + "\n" + TABLE_NOTES] if policy_rows else []
    if kv_rows:
        parts.append(_table(kv_rows, KV_COLUMNS))
    return "\n\n".join(parts)


def _table(rows: list[dict], columns) -> str:
    head = [name for name, _ in columns]
    body = [["n/a" if r.get(name) is None else fmt.format(r[name]) for name, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    first = rows[0]
    title = (f"{first['workload']}: {first['workflows']} workflows, {first['calls']} calls, gpu_tokens="
             f"{first['gpu_tokens']}, concurrency={first['concurrency']}, {first['cost_model']}")
    if first.get("replicas", 1) > 1:
        title += f", {first['replicas']} replicas (gpu_tokens in total), routing={first['routing']}"
    return "\n".join([title, line(head), *(line(b) for b in body)])


def plot(rows: list[dict], run_dir: Path) -> list[Path]:
    """hit_rate.png and latency.png of the policy comparison."""
    rows = [r for r in rows if r["comparison"] == "policies"]
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row_label(r) for r in rows]
    setting = f"{rows[0]['workload']}, gpu_tokens={rows[0]['gpu_tokens']}, C={rows[0]['concurrency']}"
    paths = []
    fig, ax = plt.subplots(figsize=(1.1 * len(rows) + 2, 4))
    gpu = [r["hit_rate"] for r in rows]
    host = [r["host_hit_tokens"] / r["prompt_tokens"] for r in rows]
    ax.bar(labels, gpu, label="GPU hit")
    ax.bar(labels, host, bottom=gpu, label="host hit", alpha=0.5)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title(f"KV-cache hit rate ({setting})")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(run_dir / "hit_rate.png")
    save_figure(fig, paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(1.1 * len(rows) + 2, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["mean_workflow_latency_s"] for r in rows], width=0.4, label="mean")
    ax.bar([i + 0.2 for i in x], [r["p99_workflow_latency_s"] for r in rows], width=0.4, label="p99")
    ax.set_xticks(list(x), labels, rotation=30)
    ax.set_ylabel("workflow latency (s)")
    ax.set_title(f"End-to-end workflow latency ({setting})")
    ax.legend()
    fig.tight_layout()
    paths.append(run_dir / "latency.png")
    save_figure(fig, paths[-1], dpi=120)
    plt.close(fig)
    return paths


def save_figure(fig, path: Path, **kwargs) -> None:
    """A matplotlib figure written atomically (data.atomic): never a truncated PNG in its place."""
    from data.atomic import atomic_file

    with atomic_file(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **kwargs)


def section_figure(fig, out: Path, name: str, alt: str) -> str:
    """A report section's figure laid out, written into `out` as `name` and closed; its Markdown line."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out / name, dpi=110)
    plt.close(fig)
    return f"![{alt}]({name})"


def log_wandb(cfg: DictConfig, summary: dict, plots: list[Path], run_dir: Path) -> None:
    """One W&B run per evaluate run: the table, the plots, and every row's metrics as summary
    scalars named POLICY[+PREFETCH]/METRIC, so runs of a sweep compare side by side."""
    import wandb

    rows = summary["rows"]
    policies = ",".join(dict.fromkeys(r["policy"] for r in rows))
    workload = rows[0]["workload"]
    name = f"{workload}-{policies}-gpu{cfg.sim.gpu_tokens}-c{cfg.sim.concurrency}"
    run = wandb.init(project=cfg.wandb.project, dir=str(run_dir), mode=cfg.wandb.mode, job_type="evaluate",
                     group=workload, name=name, config=summary["config"], reinit="finish_previous")
    columns = list(rows[0])
    run.log({"summary": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows]),
             **{p.stem: wandb.Image(str(p)) for p in plots}})
    for r in rows:
        label = row_label(r)
        for metric in ("hit_rate", "reuse_rate", "mean_workflow_latency_s", "p99_workflow_latency_s",
                       "mean_ttft_s", "throughput_calls_per_s"):
            run.summary[f"{label}/{metric}"] = r[metric]
    run.finish()
