"""The report's check of outcome trust's measurement (cache/trust.py): per seed, what its two shadow
caches estimated against the real replays of the orders they stand for.

The judge follows the score order while its shadow has at least as many GPU hits as the LRU
shadow (lifecycle-aware LRU's order), both fed the server's stream of calls. Its decision is right
where the sign of that lead matches the real one: the GPU hit rate of the policy under always trust
(its own order throughout) less pbkv_lae's. A replay under outcome trust that never switched
followed the score order from start to end, so its stream is always's and its score shadow
estimates always's real tree on the very calls it saw; the LRU shadow follows that stream too,
while the real pbkv_lae replay runs its own (prefill times, and so which calls run together,
follow the hits). So the lead's error is the shadows' whole measurement error, the stream's part
included: what a judge reading shadows of one stream cannot see."""

from __future__ import annotations

from serving_integration.experiments.rows import SETTING
from serving_integration.experiments.statistics import per_seed
from serving_integration.experiments.tables import ROBUST_TOLERANCE, md_table, robust_setting_cells

NOTE = (
    "Per seed (values separated by /), for each row of the trust modes' table above with outcome trust: its "
    "score order's shadow hit rate less the real hit rate of the same policy under always trust (its own order throughout), "
    "its lifecycle-aware LRU shadow's less pbkv_lae's real one, and the shadows' lead (score shadow less LRU "
    "shadow, over the whole replay; the judge compares it over a moving window and since its last switch) less "
    "the real lead (always less pbkv_lae), in points; then the real lead, and whether the shadows put the right "
    "order ahead (their lead has the real lead's sign, or the real lead is within 1 point). A seed marked * "
    "switched order at least once: its stream is not always's, and its score shadow's error is not one order's.")


def fidelity_cells(lae: dict, outcome: dict, always: dict) -> tuple[list[str], list[tuple]] | None:
    """The error cells of one row, and per seed (unswitched, lead error, real lead, right) for the tally;
    None where the outcome row carries no shadow rates."""
    if "shadow_hit_rate_pbkv" not in outcome:
        return None
    score, lru = per_seed(outcome, "shadow_hit_rate_pbkv"), per_seed(outcome, "shadow_hit_rate_lae")
    real_score, real_lae = per_seed(always, "hit_rate"), per_seed(lae, "hit_rate")
    switches = outcome.get("trust_switches_per_seed") or [outcome.get("trust_switches", 0)] * len(score)
    seeds = []
    for s, l, rs, rl, n in zip(score, lru, real_score, real_lae, switches):
        real_lead, lead_error = rs - rl, (s - l) - (rs - rl)
        # a real lead within the robust check's tolerance is no wrong order
        right = abs(real_lead) <= ROBUST_TOLERANCE or (s - l >= 0) == (real_lead >= 0)
        seeds.append((n == 0, s - rs, l - rl, lead_error, real_lead, right))

    def joined(i: int) -> str:
        return " / ".join(f"{100 * x[i]:+.1f}" + ("" if x[0] else "*") for x in seeds)

    cells = [joined(1), joined(2), joined(3), " / ".join(f"{100 * x[4]:+.1f}" for x in seeds),
             " / ".join("yes" if x[5] else "**no**" for x in seeds)]
    return cells, seeds


def shadow_fidelity(robust: list[tuple], others: list[str] = ()) -> str:
    """The table of `robust` (report.robustness_rows) rows with outcome trust, with the tally above it:
    in how many unswitched seeds the shadows' lead was within 1 point of the real one and had its sign,
    and the largest lead errors. `others`: setting keys that vary besides the columns
    (report.other_varying), in a column of their own."""
    body, tally = [], []
    for key, policy, pred, noise, kind, _, lae, modes in robust:
        if "outcome" not in modes:
            continue
        found = fidelity_cells(lae, modes["outcome"], modes["always"])
        if found is None:
            continue
        cells, seeds = found
        setting = robust_setting_cells(dict(zip(SETTING, key)), others)
        where = f"{', '.join(setting)}, {policy} ({pred}{'' if not noise else f', {kind} eps={noise:g}'})"
        ids = modes["outcome"].get("seeds") or [modes["outcome"].get("seed")]
        tally += [(where, seed, x) for seed, x in zip(ids, seeds)]
        body.append([*setting, policy, pred, "none" if not noise else f"{kind} eps={noise:g}",
                     ", ".join(str(s) for s in ids), *cells])
    if not body:
        return ""
    steady = [(where, seed, x) for where, seed, x in tally if x[0]]
    close = sum(abs(x[3]) <= ROBUST_TOLERANCE for _, _, x in steady)
    wrong = [(where, seed, x) for where, seed, x in steady if not x[5]]
    worst = sorted(steady, key=lambda t: -abs(t[2][3]))[:3]
    if not steady:
        text = f"Every one of the {len(tally)} replays (one per row and seed) switched order at least once."
    else:
        errors = "; ".join(f"{where}, seed {seed}: {100 * x[3]:+.1f}" for where, seed, x in worst)
        misses = "; ".join(f"{where}, seed {seed} (real lead {100 * x[4]:+.1f})" for where, seed, x in wrong)
        text = (f"Over the {len(steady)} replays (one per row and seed) that never switched (of {len(tally)}), the "
                f"shadows' lead was within 1 point of the real lead in {close}; the largest errors: {errors}. "
                + (f"The shadows put the wrong order ahead, by more than 1 point of real lead, in {len(wrong)} of them: "
                   f"{misses}." if wrong
                   else "The shadows never put the wrong order ahead by more than 1 point of real lead in them."))
    head = ["workload", "GPU tokens", "host tier", "eviction", *(["setting"] if others else []), "policy", "predictor",
            "noise", "seeds", "score shadow - always (points)", "LRU shadow - pbkv_lae (points)",
            "shadows' lead - real lead (points)", "real lead: always - pbkv_lae (points)", "shadows' order right"]
    return "\n\n".join([NOTE, text, md_table(head, body)])
