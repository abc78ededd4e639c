"""The headroom page's table of how loose the bound is (experiments/headroom.py integer_part)."""

from serving_integration.experiments.headroom import integer_part


def row(policy, hit, bound, integer=None, plan=None):
    r = {"workload": "hover", "gpu_tokens": 74_245, "gpu_working_set_fraction": 0.25, "policy": policy,
         "prefetch": "none", "trust": "none", "predictor": "none", "comparison": "policies", "hit_rate": hit,
         "bound_hit_rate": bound}
    if integer is not None:
        r.update(headroom_integer_bound_hit_rate=integer, headroom_integer_plan_hit_rate=plan)
    return r


def test_fractions_are_the_share_of_the_lead_above_the_integer_bound():
    text = integer_part([row("lru", 0.10, 0.20, 0.18, 0.17), row("lru", 0.30, 0.40, 0.40, 0.39),
                         row("pbkv_lae", 0.10, 0.20)])
    lines = [line for line in text.splitlines() if line.startswith("| hover")]
    assert len(lines) == 2  # the row without an integer search is left out
    assert lines[0].endswith("| 10.0% | 20.0% | 18.0% | 17.0% | 20% |")  # (0.20 - 0.18) / (0.20 - 0.10)
    assert lines[1].endswith("| 0% |")
    assert "account for 0% to 20% of the LP bound's lead over the row (median 10%)" in text
    assert integer_part([row("lru", 0.10, 0.20)]) == ""
    partial = {**row("lru", 0.10, 0.20, 0.18, 0.17), "partial_eviction": True}
    assert "| 74.245k (0.25 of the working set, partial eviction) | lru |" in integer_part([partial])
