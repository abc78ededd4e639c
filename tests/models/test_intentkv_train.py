"""IntentKV residual-head data (labels from the next tool calls' arguments) and a tiny training run."""

from __future__ import annotations

import json

import pytest
import torch

from models.intentkv.sessions import (argument_words, build_examples, generate_session, generate_sessions,
                                      tokenize_session, wordpiece_tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece_tokenizer()


def test_sessions_are_seeded_and_prefix_stable():
    a, b = generate_sessions(4, seed=7), generate_sessions(6, seed=7)
    assert [m.text for s in a for m in s.messages] == [m.text for s in b[:4] for m in s.messages]
    assert [m.text for m in generate_session(8, 0).messages] != [m.text for m in a[0].messages]
    s = a[0]
    assert s.messages[0].role == "system" and s.messages[1].role == "user"
    assert all(m.args for m in s.messages if m.role == "assistant")


def test_labels_are_words_of_the_next_five_calls_arguments(tokenizer):
    session = generate_session(0, 3)
    ts = tokenize_session(session, tokenizer, horizon=5)
    calls = [m for m in session.messages if m.role == "assistant"]
    assert len(ts.decisions) == len(calls)                             # every call follows a user/tool message
    assert len(ts.words) == len(ts.ids)
    n_pos = 0
    for dp in ts.decisions:
        target = set().union(*(argument_words(c.args, tokenizer) for c in calls[dp.call: dp.call + 5]))
        for j in range(dp.end):
            w = ts.words[j]
            assert bool(dp.labels[j]) == (w in target and any(ch.isalnum() for ch in w))
        n_pos += int((dp.labels & ~dp.protected).sum())
        assert bool(dp.protected[: ts.starts[1]].all()) and bool(dp.protected[dp.span_start:].all())
        assert dp.end == dp.labels.shape[0]
    assert n_pos > 0
    assert argument_words({"order_id": "ORD-12345", "path": "q3_report.csv"}, tokenizer) == \
        {"ord", "12345", "q3", "report", "csv"}


def test_examples_carry_the_memory_and_slice_the_session(tokenizer):
    from models.intentkv.minilm import WindowedQK, load_minilm
    from models.intentkv.sessions import FIXED_METHODS

    qk = WindowedQK(load_minilm(), tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]"))
    ts = tokenize_session(generate_session(0, 1), tokenizer)
    ex = build_examples([ts], qk)
    assert len(ex) == len(ts.decisions)
    for e, dp in zip(ex, ts.decisions):
        assert e.keys.shape == (6, 12, dp.end, 32) and e.rule.shape[0] == dp.end
        assert set(e.fixed) == set(FIXED_METHODS) and all(s.shape == (dp.end,) for s in e.fixed.values())
        assert torch.isclose(e.rule.sum(), torch.tensor(6.0 * 12), atol=1e-3)
    assert not torch.allclose(ex[0].memory, ex[1].memory)
    assert not torch.allclose(ex[1].rule, ex[1].fixed["current_query"])    # the memory is not the current query


def test_training_run_writes_a_loadable_head(tmp_path):
    from models.intentkv.train import load_residual_head, main, parse_config

    result = main(["sessions=synthetic", "n_sessions=5", "steps=3", "repeats=1", "rank_weights=[1.0]",
                   "window=128", "stride=128", f"out={tmp_path}"])
    assert "intent_rule+residual" in result["summary"] and result["rank_weight"] == 1.0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["config"]["steps"] == 3 and saved["config"]["sessions"] == "synthetic"
    head = load_residual_head(tmp_path / "residual_head.pt")
    assert head.config()["n_layers"] == 6
    with pytest.raises(Exception):
        parse_config(["no_such_key=1"])
    with pytest.raises(Exception, match="sessions"):
        parse_config(["sessions=other"])
