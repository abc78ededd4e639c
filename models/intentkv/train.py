"""Train the IntentKV residual head and compare it with the rule and the baselines (docs/intentkv.md).

    python -m models.intentkv.train sessions=tau_bench out=runs/intentkv       # tau-bench airline, MiniLM
    python -m models.intentkv.train sessions=synthetic out=runs/intentkv_synthetic # generated sessions
    python -m models.intentkv.train steps=3 repeats=1 rank_weights=[1.0] out=/tmp/ikv   # smoke run

Hydra key=value overrides of conf/intentkv_train.yaml; the knobs (defaults, ranges, help) are
:class:`models.config.IntentKVTrainConfig`.

Sessions: tau-bench's trajectories (:mod:`models.intentkv.tau_bench`, the ``trials`` chosen) or
generated ones (:mod:`models.intentkv.sessions`). Queries and keys: all-MiniLM-L6-v2's own
forward pass over each decision point's context, window by window (:mod:`models.intentkv.minilm`);
this is done once, and every repeat reuses the tensors. Repeat ``r`` (seed ``seed + r``) splits the
sessions by task into train / val / test, trains a head per ranking weight of ``rank_weights``
(repeat 0 only; the weight with the best validation AUROC is then used by every repeat) and scores
the test decision points.

Loss per decision point, on the candidates (unprotected tokens) sampled for the step (every
positive, ``sample_negatives`` negatives: half the top ones by rule score, half random):
``bce_weight * BCE(s, y) + rank_weight * mean softplus(s_neg - s_pos)`` over each positive and the
``hard_negatives`` highest-scoring negatives of the sample, with ``s = rule + residual`` as logit.

Metrics on the test decision points, for each method (rule, rule + head, the current-query
ablation, StreamingLLM, H2O, SnapKV, random): macro AUROC (sklearn ``roc_auc_score`` per decision
point over the candidates) and micro recall of positive tokens at each budget (``select_keep``
with protected + share of the candidates). ``summary`` gives each metric's mean and 95% t-interval
over the repeats (scipy), ``comparisons`` the paired per-repeat differences of the method pairs in
:data:`COMPARISONS` with their interval and a verdict (``better``, ``worse``, ``no difference``
when the interval contains 0). Writes ``out/residual_head.pt`` (repeat 0's head; load with
:func:`load_residual_head`), ``out/metrics.json`` and ``out/keep_masks.pt`` (every method's kept
tokens at each budget on repeat 0's test sessions, for the prefix-cache replay), all at once:
``out`` is a folder replaced whole (data.atomic), only when empty or made by this command.
"""

from __future__ import annotations

import json
import math
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from sklearn.metrics import roc_auc_score

from data.atomic import atomic_dir, check_replaceable
from data.cli import compose_config
from data.errors import ConfigError, run_reported
from data.knobs import build
from models.config import IntentKVTrainConfig as TrainConfig
from models.intentkv.pruning import ResidualHead, select_keep
from models.intentkv.sessions import Example, TokenizedSession, build_examples, generate_session, tokenize_session, \
    wordpiece_tokenizer

COMMAND = "models.intentkv.train"
HEAD = "intent_rule+residual"
METHODS = ("intent_rule", HEAD, "current_query", "streaming_llm", "h2o", "snapkv", "random")
COMPARISONS = ((HEAD, "current_query"), (HEAD, "snapkv"), (HEAD, "h2o"), (HEAD, "intent_rule"),
               ("intent_rule", "current_query"), ("intent_rule", "snapkv"), ("intent_rule", "h2o"))


def parse_config(argv: list[str]) -> TrainConfig:
    """Hydra overrides of conf/intentkv_train.yaml (an unknown key or a wrong type fails as it is
    composed), built into the checked TrainConfig (a value out of range is a ConfigError)."""
    return build(compose_config("intentkv_train", argv), TrainConfig)


# ----------------------------------------------------------------------------- data

def load_sessions(cfg: TrainConfig, tokenizer) -> tuple[list[int], list[TokenizedSession]]:
    """``(group of each session, tokenized sessions)``: the group (a tau-bench task, a synthetic
    session's index) is the unit the split assigns."""
    if cfg.sessions == "tau_bench":
        from models.intentkv.tau_bench import tau_bench_sessions

        pairs = tau_bench_sessions(cfg.tau_bench_src, cfg.trials)
        if not pairs:
            raise ConfigError(f"trials={cfg.trials}: no run of {cfg.tau_bench_src} has one of these trials")
    else:
        pairs = [(i, generate_session(cfg.seed, i)) for i in range(cfg.n_sessions)]
    return [g for g, _ in pairs], [tokenize_session(s, tokenizer, cfg.horizon) for _, s in pairs]


def make_examples(cfg: TrainConfig, sessions: list[TokenizedSession]) -> list[Example]:
    from models.intentkv.minilm import WindowedQK, load_minilm

    tokenizer = wordpiece_tokenizer()
    qk = WindowedQK(load_minilm(), tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]"),
                    cfg.window, cfg.stride)
    examples = build_examples(sessions, qk, cfg.lam, cfg.snapkv_window, cfg.sink)
    return [ex for ex in examples if (~ex.protected).any()]


# ----------------------------------------------------------------------------- loss and training

def sample_candidates(ex: Example, n_negatives: int, rng: np.random.Generator) -> torch.Tensor:
    """Positions for one step: every positive candidate, the top ``n/2`` negatives by rule score and
    ``n/2`` random other negatives."""
    cand = ~ex.protected
    pos = (ex.labels & cand).nonzero().squeeze(-1)
    neg = (~ex.labels & cand).nonzero().squeeze(-1)
    if neg.numel() > n_negatives:
        top = neg[ex.rule[neg].argsort(descending=True)[: n_negatives // 2]]
        rest = neg[~torch.isin(neg, top)]
        rand = rest[torch.from_numpy(rng.choice(rest.numel(), n_negatives - top.numel(), replace=False))]
        neg = torch.cat([top, rand])
    return torch.cat([pos, neg])


def loss_terms(scores: torch.Tensor, labels: torch.Tensor, hard_negatives: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(BCE, hard-negative pairwise ranking)`` of one decision point's sampled ``scores`` (logits)."""
    bce = F.binary_cross_entropy_with_logits(scores, labels.float())
    pos, neg = scores[labels], scores[~labels]
    if pos.numel() == 0 or neg.numel() == 0:
        return bce, scores.new_zeros(())
    hard = neg.topk(min(hard_negatives, neg.numel())).values
    return bce, F.softplus(hard[None, :] - pos[:, None]).mean()


def train_head(cfg: TrainConfig, examples: list[Example], rank_weight: float, seed: int) -> tuple[ResidualHead, list]:
    torch.manual_seed(seed)
    L, H, _, D = examples[0].key_pieces[0].shape
    head = ResidualHead(L, H, D, d_model=cfg.d_model, hidden=cfg.hidden)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    usable = [ex for ex in examples if (ex.labels & ~ex.protected).any()]
    rng = np.random.default_rng(seed)
    log = []
    for step in range(1, cfg.steps + 1):
        total = []
        for i in rng.choice(len(usable), size=min(cfg.batch, len(usable)), replace=False):
            ex = usable[i]
            positions = sample_candidates(ex, cfg.sample_negatives, rng)
            keys = ex.keys
            s = ex.rule[positions] + head(keys, keys[:, :, ex.span_start:], ex.rule, ex.memory, positions)
            bce, rank = loss_terms(s, ex.labels[positions], cfg.hard_negatives)
            total.append(cfg.bce_weight * bce + rank_weight * rank)
        loss = torch.stack(total).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(loss.item())
        if step % 50 == 0 or step == cfg.steps:
            print(f"  step {step:4d}  loss {np.mean(log[-50:]):.4f}", flush=True)
    return head.eval(), log


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def method_scores(ex: Example, head: ResidualHead | None, seed: int) -> dict[str, torch.Tensor]:
    out = dict(ex.fixed)
    if head is not None:
        keys = ex.keys
        out[HEAD] = ex.rule + head(keys, keys[:, :, ex.span_start:], ex.rule, ex.memory)
    rng = np.random.default_rng([seed, zlib.crc32(ex.session_id.encode()), ex.call])  # str hash() is salted
    out["random"] = torch.from_numpy(rng.random(ex.labels.numel()))
    return out


def budget_of(ex: Example, share: float) -> int:
    return int(ex.protected.sum()) + round(share * int((~ex.protected).sum()))


def evaluate(examples: list[Example], head: ResidualHead | None, budgets: list[float], seed: int,
             keep_masks: dict | None = None) -> dict[str, dict[str, float]]:
    """Macro AUROC over decision points and micro recall at each budget, per method; ``keep_masks``
    (when given) collects every method's kept tokens per decision point and budget."""
    aurocs: dict[str, list[float]] = {}
    kept: dict[str, dict[float, int]] = {}
    n_pos = 0
    for ex in examples:
        cand = ~ex.protected
        y = ex.labels[cand].numpy()
        n_pos += int(y.sum())
        for name, s in method_scores(ex, head, seed).items():
            if 0 < y.sum() < len(y):
                aurocs.setdefault(name, []).append(roc_auc_score(y, s[cand].numpy()))
            for share in budgets:
                keep = select_keep(s, budget_of(ex, share), ex.protected)
                kept.setdefault(name, {}).setdefault(share, 0)
                kept[name][share] += int((keep & ex.labels & cand).sum())
                if keep_masks is not None:
                    keep_masks.setdefault(name, {}).setdefault(str(share), []).append(keep)
    return {name: {"auroc": float(np.mean(aurocs[name])) if aurocs.get(name) else math.nan,  # no both-class point
                   "n_decisions_auroc": len(aurocs.get(name, [])),
                   **{f"recall@{share:g}": kept[name][share] / max(n_pos, 1) for share in budgets}}
            for name in kept}


def interval(values: list[float]) -> dict:
    """Mean and 95% t-interval over repeats (a single repeat: no interval)."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2 or np.all(v == v[0]):
        return {"mean": float(v.mean()), "low": float(v.mean()), "high": float(v.mean()), "n": len(v)}
    low, high = stats.t.interval(0.95, len(v) - 1, loc=v.mean(), scale=stats.sem(v))
    return {"mean": float(v.mean()), "low": float(low), "high": float(high), "n": len(v)}


def summarize(per_repeat: list[dict]) -> tuple[dict, dict]:
    """``(summary, comparisons)`` over the repeats' metrics (see the module docstring)."""
    metric_names = [k for k in per_repeat[0][METHODS[0]] if k != "n_decisions_auroc"]
    summary = {m: {k: interval([r[m][k] for r in per_repeat]) for k in metric_names}
               for m in METHODS if all(m in r for r in per_repeat)}
    comparisons = {}
    for a, b in COMPARISONS:
        if a not in summary or b not in summary:
            continue
        for k in metric_names:
            iv = interval([r[a][k] - r[b][k] for r in per_repeat])
            verdict = ("no difference" if iv["low"] <= 0 <= iv["high"] else "better" if iv["low"] > 0 else "worse")
            comparisons[f"{a} vs {b}: {k}"] = {**iv, "verdict": verdict}
    return summary, comparisons


def format_table(summary: dict, budgets: list[float]) -> str:
    cols = ["auroc", *[f"recall@{b:g}" for b in budgets]]
    lines = [f"{'method':<22}" + "".join(f"{c:>24}" for c in cols)]
    for name, m in summary.items():
        lines.append(f"{name:<22}" + "".join(f"{m[c]['mean']:>8.3f} [{m[c]['low']:.3f}, {m[c]['high']:.3f}]"
                                            for c in cols))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- checkpoint

def save_residual_head(head: ResidualHead, path: Path, extra: dict) -> None:
    torch.save({"config": head.config(), "state_dict": head.state_dict(), **extra}, path)


def load_residual_head(path: str | Path) -> ResidualHead:
    from models.checkpoint import CheckpointError

    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)  # never runs code from the file
        head = ResidualHead(**blob["config"])
        head.load_state_dict(blob["state_dict"])
    except FileNotFoundError:
        raise
    except Exception as e:  # torch raises several types for foreign, truncated or hostile files
        raise CheckpointError(f"{path}: not a readable residual head: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from e
    return head.eval()


# ----------------------------------------------------------------------------- command

def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    check_replaceable(cfg.out, (COMMAND,))  # before the work: a refusal costs nothing
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(threads)


def split_examples(cfg: TrainConfig, groups: list[int], sessions: list[TokenizedSession], examples: list[Example],
                   seed: int) -> dict[str, list[Example]]:
    from models.intentkv.tau_bench import split_runs

    split_of = dict(zip((ts.session_id for ts in sessions), split_runs(groups, cfg.val, cfg.test, seed)))
    out: dict[str, list[Example]] = {"train": [], "val": [], "test": []}
    for ex in examples:
        out[split_of[ex.session_id]].append(ex)
    return out


def shared_system_prefix(sessions: list[TokenizedSession]) -> bool:
    """Whether every session starts with the same system prompt tokens (tau-bench's policy text)."""
    first = sessions[0].ids[: sessions[0].starts[1]]
    return all(torch.equal(ts.ids[: ts.starts[1]], first) for ts in sessions)


def run(cfg: TrainConfig) -> dict:
    t0 = time.time()
    tokenizer = wordpiece_tokenizer()
    groups, sessions = load_sessions(cfg, tokenizer)
    examples = make_examples(cfg, sessions)
    pos_rate = float(np.mean([(ex.labels & ~ex.protected).sum() / (~ex.protected).sum() for ex in examples]))
    context = float(np.mean([ex.labels.numel() for ex in examples]))
    print(f"{cfg.sessions}: {len(sessions)} sessions, {len(examples)} decision points, mean context {context:.0f} "
          f"tokens, positive rate {pos_rate:.3f}; MiniLM Q/K in {time.time() - t0:.0f}s", flush=True)
    per_repeat, selection, heads, keep_masks, splits = [], {}, [], {}, []
    rank_weight = cfg.rank_weights[0]
    for r in range(cfg.repeats):
        seed = cfg.seed + r
        split = split_examples(cfg, groups, sessions, examples, seed)
        if not split["train"] or not split["test"]:
            raise ConfigError(f"val={cfg.val} test={cfg.test}: repeat {r} leaves no train or no test decision point")
        splits.append({k: len(v) for k, v in split.items()})
        if r == 0 and len(cfg.rank_weights) > 1:
            if not split["val"]:
                raise ConfigError(f"val={cfg.val}: no validation decision point to choose rank_weights on")
            for w in cfg.rank_weights:
                print(f"repeat 0, rank_weight {w}: training on {len(split['train'])} decision points", flush=True)
                head, _ = train_head(cfg, split["train"], w, seed)
                selection[str(w)] = evaluate(split["val"], head, cfg.budgets, seed)[HEAD]["auroc"]
            rank_weight = float(max(cfg.rank_weights, key=lambda w: np.nan_to_num(selection[str(w)], nan=-1.0)))
            print(f"validation AUROC by rank_weight {selection}: using {rank_weight}", flush=True)
        print(f"repeat {r} (seed {seed}): training on {len(split['train'])} decision points", flush=True)
        head, log = train_head(cfg, split["train"], rank_weight, seed)
        heads.append((head, log))
        per_repeat.append(evaluate(split["test"], head, cfg.budgets, seed, keep_masks if r == 0 else None))
        if r == 0:
            keep_masks.update(methods=[m for m in METHODS if m in keep_masks], budgets=[str(b) for b in cfg.budgets],
                              system_prefix_shared=shared_system_prefix(sessions),
                              decisions=[{"session": ex.session_id, "call": ex.call, "end": ex.labels.numel(),
                                          "system_end": ex.system_end, "output_tokens": ex.output_tokens}
                                         for ex in split["test"]])
    summary, comparisons = summarize(per_repeat)
    print(format_table(summary, cfg.budgets))
    for name, c in comparisons.items():
        print(f"  {name}: {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] {c['verdict']}")
    result = {"config": asdict(cfg), "n_sessions": len(sessions), "n_decisions": len(examples),
              "splits": splits, "positive_rate": pos_rate, "mean_context_tokens": context,
              "rank_weight": rank_weight, "rank_weight_validation_auroc": selection,
              "final_loss": float(np.mean(heads[0][1][-20:])), "per_repeat": per_repeat, "summary": summary,
              "comparisons": comparisons, "seconds": time.time() - t0}
    out = Path(cfg.out)
    with atomic_dir(out, COMMAND) as tmp:
        save_residual_head(heads[0][0], tmp / "residual_head.pt", {"lam": cfg.lam, "summary": summary})
        torch.save(keep_masks, tmp / "keep_masks.pt")
        (tmp / "metrics.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'metrics.json'}, {out / 'residual_head.pt'} and {out / 'keep_masks.pt'} "
          f"({time.time() - t0:.0f}s)")
    return result


if __name__ == "__main__":
    sys.exit(run_reported(main))
