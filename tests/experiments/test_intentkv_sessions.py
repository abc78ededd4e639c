"""The IntentKV trainer's pruned sessions as simulator workflows: the units and token counts of
each layout, drops that stick under sentinel slots, and the replay's prefix hit rates."""

from __future__ import annotations

import torch

from serving_integration.experiments.intentkv_sessions import replay_rows, session_workflows


def masks_of(keeps: list[list[int]]) -> dict:
    """One session of two decision points (contexts of 6 and 10 tokens, system prefix 2)."""
    decisions = [{"session": "s", "call": 0, "end": 6, "system_end": 2, "output_tokens": 3},
                 {"session": "s", "call": 1, "end": 10, "system_end": 2, "output_tokens": 3}]
    return {"decisions": decisions, "methods": ["m"], "budgets": ["0.5"], "system_prefix_shared": True,
            "m": {"0.5": [torch.tensor(k, dtype=torch.bool) for k in keeps]}}


def test_units_per_layout_and_sticky_sentinel_drops():
    masks = masks_of([[1, 1, 0, 1, 0, 1], [1, 1, 1, 1, 0, 1, 0, 0, 1, 1]])
    compaction = session_workflows(masks, "m", "0.5", "compaction")[0].calls
    assert compaction[0].units == ("system:0", "system:1", "s:3", "s:5")
    assert compaction[1].units == ("system:0", "system:1", "s:2", "s:3", "s:5", "s:8", "s:9")
    sentinel = session_workflows(masks, "m", "0.5", "sentinel")[0].calls
    assert sentinel[0].units == ("system:0", "system:1", "s:2", "s:3", "s:4", "s:5")
    assert sentinel[0].lens == (1, 1, 0, 1, 0, 1)
    assert sentinel[1].lens == (1, 1, 0, 1, 0, 1, 0, 0, 1, 1)     # position 2 was dropped when computed
    none = session_workflows(masks, "m", "0.5", "none")[0].calls
    assert none[1].lens == (1,) * 10 and none[1].output_tokens == 3


def test_sentinel_keeps_the_prefix_match_that_compaction_breaks():
    # the second call drops position 2, which the first kept: compaction's kept sequence then differs
    # right after the system prefix, the sentinel's full sequence still matches
    rows = replay_rows(masks_of([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1, 1, 1, 1]]), "test")
    rate = {r["layout"]: r["reuse_rate"] for r in rows if r["workload"] == "test"}
    assert set(rate) == {"none", "compaction", "sentinel"}
    # sentinel: 5 of call 1's 9 kept tokens were computed by call 0 (positions 0, 1, 3, 4, 5)
    assert abs(rate["sentinel"] - 5 / 15) < 1e-9
    # compaction: only the 2 system tokens match
    assert abs(rate["compaction"] - 2 / 15) < 1e-9
    # after the system prompt: call 1's 7 kept history tokens, 3 of them computed by call 0 under sentinel
    history = {r["layout"]: r["reuse_rate"] for r in rows if r["workload"] == "test (after the system prompt)"}
    assert abs(history["sentinel"] - 3 / 11) < 1e-9 and history["compaction"] == 0
