"""Train the IntentKV residual head on generated text sessions (docs/intentkv.md).

    python -m models.intentkv.train steps=200 out=runs/intentkv
    python -m models.intentkv.train steps=50 n_train=20 n_test=10 out=/tmp/ikv     # smoke run

Hydra key=value overrides of conf/intentkv_train.yaml; the knobs (defaults, ranges, help) are
:class:`models.config.IntentKVTrainConfig`.
Sessions come from :mod:`models.intentkv.sessions` (train: sessions ``0 .. n_train-1`` of ``seed``,
held out: the next ``n_test``); K/Q from a small randomly initialised Llama. The loss is a listwise
softmax cross-entropy of ``rule + residual`` over each decision point's unprotected tokens, with
the positives as a uniform target. On the held-out decision points it prints, for the rule score,
rule + residual and the three baselines: macro label AUROC (sklearn ``roc_auc_score``, per decision
point, over unprotected tokens) and top-budget recall (``select_keep`` with budget = protected +
``budget_frac`` of the unprotected tokens; positives kept / positives). Writes
``out/residual_head.pt`` (load with :func:`load_residual_head`) and ``out/metrics.json``, both
at once: ``out`` is a folder replaced whole (data.atomic), only when empty or made by this command.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from data.atomic import atomic_dir, check_replaceable
from data.cli import compose_config
from data.errors import run_reported
from data.knobs import build
from models.config import IntentKVTrainConfig as TrainConfig

from models.intentkv.pruning import ResidualHead, causal_attention, h2o_scores, select_keep, snapkv_scores, \
    streaming_llm_scores
from models.intentkv.sessions import Example, build_examples, generate_session, tiny_llama, tokenize_session, \
    wordpiece_tokenizer


COMMAND = "models.intentkv.train"


def parse_config(argv: list[str]) -> TrainConfig:
    """Hydra overrides of conf/intentkv_train.yaml (an unknown key or a wrong type fails as it is
    composed), built into the checked TrainConfig (a value out of range is a ConfigError)."""
    return build(compose_config("intentkv_train", argv), TrainConfig)


def make_examples(cfg: TrainConfig, model, tokenizer, first: int, n: int) -> list[Example]:
    sessions = [tokenize_session(generate_session(cfg.seed, i), tokenizer, cfg.horizon)
                for i in range(first, first + n)]
    return [ex for ex in build_examples(sessions, model, cfg.lam) if (~ex.protected).any()]


def listwise_loss(scores: torch.Tensor, labels: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor | None:
    """``-mean_{j in pos} log softmax_{candidates}(scores)_j``; None without a positive candidate."""
    pos = labels & candidates
    if not pos.any():
        return None
    s = scores[candidates]
    return torch.logsumexp(s, dim=0) - scores[pos].mean()


def residual_scores(head: ResidualHead, ex: Example) -> torch.Tensor:
    return ex.rule + head(ex.keys, ex.span_keys, ex.rule, ex.memory)


def method_scores(ex: Example, head: ResidualHead | None, baselines: bool) -> dict[str, torch.Tensor]:
    out = {"intent_rule": ex.rule}
    if head is not None:
        with torch.no_grad():
            out["intent_rule+residual"] = residual_scores(head, ex)
    if baselines:
        out["streaming_llm"] = streaming_llm_scores(ex.keys.shape[2], sink=4)
        out["h2o"] = h2o_scores(causal_attention(ex.queries, ex.keys))
        out["snapkv"] = snapkv_scores(ex.span_queries, ex.keys)
    return out


def evaluate(examples: list[Example], head: ResidualHead | None, budget_frac: float,
             baselines: bool = True) -> dict[str, dict[str, float]]:
    """Macro AUROC over decision points and micro top-budget recall, per method."""
    aurocs: dict[str, list[float]] = {}
    kept: dict[str, int] = {}
    n_pos = 0
    for ex in examples:
        cand = ~ex.protected
        y = ex.labels[cand].numpy()
        n_pos += int(y.sum())
        budget = int(ex.protected.sum()) + round(budget_frac * int(cand.sum()))
        for name, s in method_scores(ex, head, baselines).items():
            if 0 < y.sum() < len(y):
                aurocs.setdefault(name, []).append(roc_auc_score(y, s[cand].numpy()))
            keep = select_keep(s, budget, ex.protected)
            kept[name] = kept.get(name, 0) + int((keep & ex.labels & cand).sum())
    return {name: {"auroc": float(np.mean(aurocs[name])), "recall_at_budget": kept[name] / max(n_pos, 1),
                   "n_decisions_auroc": len(aurocs[name])} for name in aurocs}


def train_head(cfg: TrainConfig, examples: list[Example], dims: tuple[int, int, int]) -> tuple[ResidualHead, list]:
    head = ResidualHead(*dims, d_model=cfg.d_model, hidden=cfg.hidden)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    usable = [ex for ex in examples if (ex.labels & ~ex.protected).any()]
    rng = np.random.default_rng(cfg.seed)
    log = []
    for step in range(1, cfg.steps + 1):
        losses = [listwise_loss(residual_scores(head, usable[i]), usable[i].labels, ~usable[i].protected)
                  for i in rng.choice(len(usable), size=min(cfg.batch, len(usable)), replace=False)]
        loss = torch.stack([x for x in losses if x is not None]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(loss.item())
        if step % 50 == 0 or step == cfg.steps:
            print(f"step {step:4d}  loss {np.mean(log[-50:]):.4f}", flush=True)
    return head, log


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


def format_table(metrics: dict[str, dict[str, float]], budget_frac: float) -> str:
    lines = [f"{'method':<22} {'AUROC':>7} {'recall@' + format(budget_frac, '.0%'):>12}"]
    for name, m in metrics.items():
        lines.append(f"{name:<22} {m['auroc']:7.3f} {m['recall_at_budget']:12.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    check_replaceable(cfg.out, (COMMAND,))  # before the work: a refusal costs nothing
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(threads)


def run(cfg: TrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    tokenizer = wordpiece_tokenizer()
    model = tiny_llama(tokenizer.get_vocab_size(), seed=cfg.seed, hidden_size=cfg.model_hidden,
                       n_layers=cfg.model_layers, n_heads=cfg.model_heads, attn_implementation="sdpa")
    train = make_examples(cfg, model, tokenizer, 0, cfg.n_train)
    test = make_examples(cfg, model, tokenizer, cfg.n_train, cfg.n_test)
    pos_rate = float(np.mean([(ex.labels & ~ex.protected).sum() / (~ex.protected).sum() for ex in test]))
    print(f"{len(train)} train / {len(test)} held-out decision points, mean context "
          f"{np.mean([ex.keys.shape[2] for ex in test]):.0f} tokens, positive rate {pos_rate:.3f} "
          f"({time.time() - t0:.1f}s)", flush=True)
    L, H, _, D = train[0].keys.shape
    head, log = train_head(cfg, train, (L, H, D))
    head.eval()
    metrics = evaluate(test, head, cfg.budget_frac, cfg.baselines)
    print(format_table(metrics, cfg.budget_frac))
    print(f"random: AUROC 0.500, recall@budget ~{cfg.budget_frac:.3f}; total {time.time() - t0:.1f}s")
    out = Path(cfg.out)
    result = {"config": asdict(cfg), "n_train_decisions": len(train), "n_test_decisions": len(test),
              "positive_rate": pos_rate, "final_loss": float(np.mean(log[-20:])) if log else math.nan,
              "metrics": metrics, "seconds": time.time() - t0}
    with atomic_dir(out, COMMAND) as tmp:
        save_residual_head(head, tmp / "residual_head.pt", {"lam": cfg.lam, "metrics": metrics})
        (tmp / "metrics.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'residual_head.pt'} and {out / 'metrics.json'}")
    return result


if __name__ == "__main__":
    sys.exit(run_reported(main))
