"""IntentKV on tau-bench with MiniLM: the converter's labels on a hand-checked trajectory, MiniLM's
queries and keys against its weights, the windowing, and the trainer end to end on real runs."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from data.errors import TraceValidationError
from models.intentkv.minilm import WindowedQK, capture_qk, load_minilm, window_of
from models.intentkv.sessions import argument_words, tokenize_session, wordpiece_tokenizer
from models.intentkv.tau_bench import split_runs, tau_bench_sessions

TAU_BENCH = "data/traces/tau_bench/gpt-4o-airline.json.gz"


def call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# A trajectory written by hand, in the published format. Decision points: before each of the 3 tool calls.
TRAJ = [
    {"role": "system", "content": "Airline policy: help the user."},
    {"role": "user", "content": "Hi, I am mia_li_3668 and want to add a bag."},
    {"role": "assistant", "content": None, "tool_calls": [call(0, "get_user_details", {"user_id": "mia_li_3668"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"reservations": ["ABC123", "XYZ789"], "city": "Boston"}'},
    {"role": "assistant", "content": None,
     "tool_calls": [call(1, "get_reservation_details", {"reservation_id": "XYZ789"})]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"flight": "HAT136", "passengers": 1}'},
    {"role": "assistant", "content": "Which passenger?"},
    {"role": "user", "content": "Just me, Mia Li."},
    {"role": "assistant", "content": None, "tool_calls": [call(2, "update_baggages", {
        "reservation_id": "XYZ789", "total_baggages": 2,
        "passengers": [{"first_name": "Mia", "last_name": "Li"}]})]},
    {"role": "tool", "tool_call_id": "call_2", "content": "done"},
]


def write_runs(path, runs):
    path.write_text(json.dumps(runs))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece_tokenizer()


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


def positives(ts, dp):
    """(message index, word) of every positive token of a decision point."""
    msg = [max(i for i, s in enumerate(ts.starts) if s <= j) for j in range(dp.end)]
    return {(msg[j], ts.words[j]) for j in range(dp.end) if dp.labels[j]}


def test_labels_on_a_hand_checked_trajectory(tmp_path, tokenizer):
    src = write_runs(tmp_path / "runs.json", [{"task_id": 7, "trial": 0, "info": {"task": {"instruction": "x"}},
                                               "traj": TRAJ}])
    [(task, session)] = tau_bench_sessions(src)
    assert task == 7 and session.session_id == "tau_bench-7-0"
    assert [m.role for m in session.messages] == [e["role"] for e in TRAJ]
    assert [m.tool for m in session.messages if m.tool] == ["get_user_details", "get_reservation_details",
                                                            "update_baggages"]
    assert session.messages[2].text == ('assistant: <tool_call id="call_0" name="get_user_details">'
                                        '{"user_id": "mia_li_3668"}</tool_call>')
    ts = tokenize_session(session, tokenizer, horizon=2)
    # a decision point before each call; the third follows a user line (the text reply is no call)
    assert [(dp.call, dp.span_start) for dp in ts.decisions] == [(0, ts.starts[1]), (1, ts.starts[3]),
                                                                 (2, ts.starts[7])]
    d0, d1, d2 = ts.decisions
    # before call 0 (horizon 2: calls 0 and 1): "mia", "li", "3668" of the user id in the user line
    # (the "_" are punctuation); XYZ789 is argued by call 1 but not yet in the context
    assert positives(ts, d0) == {(1, "mia"), (1, "li"), (1, "3668")}
    # before call 1 (calls 1, 2): XYZ789 in the tool result; "mia" and "li" of the user id (in the user
    # line and in call 0's own JSON) are values of call 2's nested passenger list, while "3668" was
    # argued by call 0 only, which is past; call 2's "2" is spelled by no history token
    assert positives(ts, d1) == {(1, "mia"), (1, "li"), (2, "mia"), (2, "li"), (3, "xyz789")}
    # before call 2 (call 2 only): besides those, XYZ789 in call 1's JSON and Mia / Li in the last user
    # line; "passengers" (a key of call 2's arguments, and a word of tool result 5) is no value
    assert positives(ts, d2) == {(1, "mia"), (1, "li"), (2, "mia"), (2, "li"), (3, "xyz789"), (4, "xyz789"),
                                 (7, "mia"), (7, "li")}
    assert argument_words({"passengers": [{"first_name": "Mia"}], "n": 2, "ok": True}, tokenizer) == \
        {"mia", "2", "true"}
    for dp in ts.decisions:   # protected: system prefix and latest span; candidates: the rest
        assert dp.protected[: ts.starts[1]].all() and dp.protected[dp.span_start:].all()
        assert not dp.protected[ts.starts[1]: dp.span_start].any()


def test_published_trajectories_convert_and_split_by_task():
    sessions = tau_bench_sessions(TAU_BENCH, trials=[0, 1])
    assert len(sessions) == 100 and {s.session_id.rsplit("-", 1)[1] for _, s in sessions} == {"0", "1"}
    groups = [t for t, _ in sessions]
    split = split_runs(groups, val=0.2, test=0.2, seed=3)
    assert split == split_runs(groups, val=0.2, test=0.2, seed=3) != split_runs(groups, val=0.2, test=0.2, seed=4)
    by_task = {}
    for t, s in zip(groups, split):
        by_task.setdefault(t, set()).add(s)
    assert all(len(v) == 1 for v in by_task.values())                  # both trials of a task on one side
    assert sum(v == {"test"} for v in by_task.values()) == 10 and sum(v == {"val"} for v in by_task.values()) == 10


def test_a_bad_trajectory_is_named(tmp_path):
    bad = [{"task_id": 1, "trial": 0, "info": {"task": {"instruction": "x"}}, "traj": TRAJ[:1] + TRAJ[2:]}]
    with pytest.raises(TraceValidationError, match=r"run 0: field 'traj\[1\].role'"):
        tau_bench_sessions(write_runs(tmp_path / "bad.json", bad))


def test_minilm_queries_and_keys_are_the_modules_projections(minilm, tokenizer):
    ids = torch.tensor(tokenizer.encode("[CLS] the flight HAT136 leaves Boston on May 20. [SEP]",
                                        add_special_tokens=False).ids)
    q, k = capture_qk(minilm, ids)
    assert q.shape == k.shape == (6, 12, ids.numel(), 32)
    with torch.no_grad():
        hidden = minilm(input_ids=ids[None], output_hidden_states=True).hidden_states   # input of each layer
    for layer, attn in enumerate(minilm.encoder.layer):
        x = hidden[layer][0]
        direct_q = (x @ attn.attention.self.query.weight.T + attn.attention.self.query.bias).view(-1, 12, 32)
        direct_k = (x @ attn.attention.self.key.weight.T + attn.attention.self.key.bias).view(-1, 12, 32)
        assert torch.allclose(q[layer], direct_q.transpose(0, 1), atol=1e-5)
        assert torch.allclose(k[layer], direct_k.transpose(0, 1), atol=1e-5)
    # the attention recomputed from them is the one the model applies (H2O's accumulated attention)
    from transformers import BertModel
    from models.intentkv.minilm import minilm_dir

    eager = BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()
    with torch.no_grad():
        att = torch.stack(eager(input_ids=ids[None], output_attentions=True).attentions)[:, 0]
    assert torch.allclose((q @ k.transpose(-1, -2) / math.sqrt(32)).softmax(-1), att, atol=1e-5)


def test_windows_tile_the_context_and_never_see_past_its_end(minilm):
    window, stride = 8, 4
    assert window_of(torch.arange(14), window, stride).tolist() == [0] * 8 + [1] * 4 + [2] * 2
    ids = torch.randint(1000, 20000, (30,), generator=torch.Generator().manual_seed(0))
    qk = WindowedQK(minilm, 101, 102, window=window, stride=stride)
    q, k, h = qk.context(ids, 14)
    assert q.shape == (6, 12, 14, 32) and h.shape == (14,)
    frame = lambda a, b: torch.cat([torch.tensor([101]), ids[a:b], torch.tensor([102])])
    for pos, (a, b) in {3: (0, 8), 9: (4, 12), 13: (8, 14)}.items():   # 13: window 2 = [8, 16) cut at 14
        wq, wk = capture_qk(minilm, frame(a, b))
        assert torch.allclose(k[:, :, pos], wk[:, :, 1 + pos - a], atol=2e-2)   # float16 copies
        assert torch.allclose(q[:, :, pos], wq[:, :, 1 + pos - a], atol=2e-2)
    assert qk.windows_run == 3
    changed = ids.clone()
    changed[14:] = 2000                                                  # tokens after the context's end
    q2, k2, _ = qk.context(changed, 14)
    assert torch.equal(k, k2) and torch.equal(q, q2)
    assert qk.windows_run == 4                                           # windows 0, 1 cached; 2 re-run (cut)
    with pytest.raises(ValueError, match="should divide"):
        WindowedQK(minilm, 101, 102, window=8, stride=3)
    with pytest.raises(ValueError, match="at most 510"):
        WindowedQK(minilm, 101, 102, window=600, stride=300)


def test_shared_windows_are_reused_across_sessions(minilm):
    qk = WindowedQK(minilm, 101, 102, window=8, stride=8)
    prefix = torch.arange(2000, 2016)
    a, b = torch.cat([prefix, torch.arange(3000, 3010)]), torch.cat([prefix, torch.arange(4000, 4010)])
    qk.context(a, 26, shared_until=16)
    qk.new_session()
    before = qk.windows_run
    _, kb, _ = qk.context(b, 26, shared_until=16)
    assert qk.windows_run - before == 2                                  # only b's own windows: [16, 24), [24, 26)
    _, kd, _ = WindowedQK(minilm, 101, 102, window=8, stride=8).context(b, 26)
    assert torch.equal(kb, kd)


def test_trainer_end_to_end_on_real_runs(tmp_path):
    from models.intentkv.train import load_residual_head, main

    runs = json.loads(gzip.decompress(open(TAU_BENCH, "rb").read()))
    short = sorted((r for r in runs if r["trial"] == 0 and any(e.get("tool_calls") for e in r["traj"])),
                   key=lambda r: len(json.dumps(r["traj"])))[:6]
    src = write_runs(tmp_path / "six.json", short)
    out = tmp_path / "run"
    result = main(["sessions=tau_bench", f"tau_bench_src={src}", "steps=3", "repeats=2", "rank_weights=[0.5,1.0]",
                   "val=0.2", "test=0.3", "window=64", "stride=32", f"out={out}"])
    assert result["n_sessions"] == 6 and result["rank_weight"] in (0.5, 1.0)
    assert set(result["rank_weight_validation_auroc"]) == {"0.5", "1.0"}
    saved = json.loads((out / "metrics.json").read_text())
    assert set(saved["summary"]) == {"intent_rule", "intent_rule+residual", "current_query", "streaming_llm", "h2o",
                                     "snapkv", "random"}
    for m in saved["summary"].values():
        assert set(m) == {"auroc", "recall@0.1", "recall@0.25", "recall@0.5"}
        assert m["recall@0.5"]["low"] <= m["recall@0.5"]["mean"] <= m["recall@0.5"]["high"]
        assert m["recall@0.1"]["mean"] <= m["recall@0.25"]["mean"] <= m["recall@0.5"]["mean"]
    assert any(c["verdict"] in ("better", "worse", "no difference") for c in saved["comparisons"].values())
    assert load_residual_head(out / "residual_head.pt").config()["n_layers"] == 6
    masks = torch.load(out / "keep_masks.pt")
    assert len(masks["snapkv"]["0.25"]) == len(masks["decisions"])
