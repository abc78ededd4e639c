"""IntentKV: layouts checked against a real attention implementation, scoring, baselines.

The model is a randomly initialised 2-layer Llama built from a config (nothing is downloaded).
History K/V come from its own KV cache; the latest span is then run through its real decoder
layers (eager attention) on top of a hand-built cache:

* reference: the kept history rows at their original positions, span at positions T..T+S-1;
* sentinel: the slot table (dropped positions read the sentinel slot), same positions;
* compaction: the kept rows moved to slots 0..n-1, span at n..n+S-1 (positions shift).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.intentkv.pruning import (LAYOUTS, METHODS, SENTINEL_KEY, IntentKV, ResidualHead, apply_layout,
                             causal_attention, compact, encode_span, h2o_scores, rope_rotate, rule_scores,
                             scores_for, select_keep, sentinel_bias, sentinel_layout, slot_attention,
                             snapkv_scores, streaming_llm_scores, update_memory)
from models.intentkv.sessions import capture_qkv, tiny_llama

T_HIST, S, SYS = 48, 8, 6
ATOL = 1e-5


# ----------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def llama():
    # init_range 0.1: attention logits of a few units, so that phase errors are visible
    return tiny_llama(vocab_size=500, seed=0, hidden_size=64, n_layers=2, n_heads=4, max_positions=512,
                      init_range=0.1)


@pytest.fixture(scope="module")
def session(llama):
    g = torch.Generator().manual_seed(1)
    hist = torch.randint(0, 500, (T_HIST,), generator=g)
    span = torch.randint(0, 500, (S,), generator=g)
    _, k_hist, v_hist = capture_qkv(llama, hist)                       # history prefill: the KV cache
    q_all, k_all, v_all = capture_qkv(llama, torch.cat([hist, span]))   # span queries (post-RoPE)
    protected = torch.zeros(T_HIST, dtype=torch.bool)
    protected[:SYS] = True
    keep = IntentKV().prune(k_all, v_all, q_all[:, :, T_HIST:], budget=SYS + 20,
                            protected=torch.cat([protected, torch.ones(S, dtype=torch.bool)]),
                            layout="sentinel").keep[:T_HIST]
    return {"hist": hist, "span": span, "k": k_hist, "v": v_hist, "q_all": q_all, "k_all": k_all, "v_all": v_all,
            "keep": keep}


def run_span(model, span_ids, kv, positions, hist_bias=None):
    """Span tokens through the real decoder layers over a cache holding ``kv`` ([L, H, N, D] each);
    ``hist_bias [N]`` is added to the logits of the cached entries. Returns each layer's output."""
    from transformers import DynamicCache

    base = model.model
    keys, values = kv
    n = keys.shape[2]
    cache = DynamicCache()
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None], values[layer][None], layer)
    s = span_ids.shape[0]
    mask = torch.zeros(s, n + s)
    if hist_bias is not None:
        mask[:, :n] += hist_bias
    mask[:, n:] = torch.full((s, s), float("-inf")).triu(1)
    hidden = base.embed_tokens(span_ids[None])
    pe = base.rotary_emb(hidden, positions[None])
    outs = []
    with torch.no_grad():
        for layer in base.layers:
            hidden = layer(hidden, attention_mask=mask[None, None], position_embeddings=pe,
                           past_key_values=cache, use_cache=True)
            outs.append(hidden[0])
    return outs


def reference(llama, ses):
    keep = ses["keep"]
    kv = (ses["k"][:, :, keep], ses["v"][:, :, keep])
    return run_span(llama, ses["span"], kv, torch.arange(T_HIST, T_HIST + S))


def sentinel_run(llama, ses, mask_sentinel=True):
    k_ws, v_ws, slot = sentinel_layout(ses["k"], ses["v"], ses["keep"])
    kv = (k_ws[:, :, slot], v_ws[:, :, slot])                           # the slot table, read per position
    bias = sentinel_bias(slot) if mask_sentinel else None
    return run_span(llama, ses["span"], kv, torch.arange(T_HIST, T_HIST + S), bias)


def test_capture_matches_the_models_cache(llama, session):
    # causal model: the history's K/V are the first T_HIST rows of the longer run's
    assert torch.allclose(session["k_all"][:, :, :T_HIST], session["k"], atol=ATOL)
    q, k, v = capture_qkv(llama, session["hist"][:5])
    assert q.shape == k.shape == v.shape == (2, 4, 5, 16)


# (a) sentinel slots == kept tokens at their original positions, every layer
def test_sentinel_layout_equals_kept_tokens_at_original_positions(llama, session):
    assert 0 < int(session["keep"].sum()) < T_HIST
    ref, sen = reference(llama, session), sentinel_run(llama, session)
    for r, s in zip(ref, sen):
        assert torch.allclose(r, s, atol=ATOL), (r - s).abs().max()


# (b) compaction breaks it; re-encoding RoPE at compacted positions matches a fresh run on layer 0 only
def test_compaction_changes_attention(llama, session):
    k_c, v_c, pos = compact(session["k"], session["v"], session["keep"])
    n = pos.numel()
    shifted = run_span(llama, session["span"], (k_c, v_c), torch.arange(n, n + S))
    ref = reference(llama, session)
    assert (shifted[0] - ref[0]).abs().max() > 1e-2
    assert (shifted[-1] - ref[-1]).abs().max() > 1e-2


def test_compaction_with_reencoded_positions_matches_a_fresh_run_on_the_first_layer(llama, session):
    k_c, v_c, pos = compact(session["k"], session["v"], session["keep"])
    n = pos.numel()
    inv_freq = llama.model.rotary_emb.inv_freq
    k_re = rope_rotate(k_c, torch.arange(n) - pos, inv_freq)          # re-apply RoPE at positions 0..n-1
    compacted = run_span(llama, session["span"], (k_re, v_c), torch.arange(n, n + S))
    tokens = torch.cat([session["hist"][session["keep"]], session["span"]])
    fresh = run_span(llama, tokens, (k_re[:, :, :0], v_c[:, :, :0]), torch.arange(n + S))
    fresh = [f[n:] for f in fresh]
    assert torch.allclose(compacted[0], fresh[0], atol=1e-4)           # layer 0: K/V depend on token + position only
    assert (compacted[1] - fresh[1]).abs().max() > 1e-2               # layer 1: the kept rows saw the dropped context
    assert (compacted[0] - reference(llama, session)[0]).abs().max() > 1e-2   # and the gaps are gone


def test_rope_rotate_reencodes_a_key(llama, session):
    _, k_far, _ = capture_qkv(llama, torch.cat([torch.zeros(30, dtype=torch.long), session["hist"][:4]]))
    inv_freq = llama.model.rotary_emb.inv_freq
    moved = rope_rotate(k_far[0, :, 30:], torch.full((4,), -30), inv_freq)   # layer 0 only
    assert torch.allclose(moved, session["k"][0, :, :4], atol=1e-4)


# (c) the sentinel's weight
def test_masked_sentinel_gets_zero_weight_for_any_query(session):
    k_ws, v_ws, slot = sentinel_layout(session["k"], session["v"], session["keep"])
    real = session["q_all"][:, :, T_HIST:]
    wild = torch.randn(2, 4, 64, 16) * 100                            # arbitrary queries, either sign
    for q in (real, wild, -wild):
        _, w = slot_attention(q, k_ws, v_ws, slot, torch.full((q.shape[2],), T_HIST), return_weights=True)
        assert float(w[..., ~session["keep"]].sum()) == 0.0
        assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)), atol=ATOL)


def test_key_only_sentinel_is_near_zero_only_when_the_query_components_sum_positive(session):
    """The literal design (K = -1e4 * 1, no mask): logit -1e4 * sum(q) / sqrt(D). ~0 weight when
    sum(q) > 0, but ~all the weight when sum(q) < 0 -- which real queries of this model do."""
    k_ws, v_ws, slot = sentinel_layout(session["k"], session["v"], session["keep"])
    q = session["q_all"][:, :, T_HIST:]
    _, w = slot_attention(q, k_ws, v_ws, slot, torch.full((S,), T_HIST), mask_sentinel=False, return_weights=True)
    w_sent = w[..., ~session["keep"]].sum(-1)                          # [L, H, S]
    total = q.sum(-1)
    assert (total > 0.05).any() and (total < -0.05).any()
    assert float(w_sent[total > 0.05].max()) < 1e-6
    assert float(w_sent[total < -0.05].min()) > 0.99
    assert torch.all(k_ws[..., -1, :] == SENTINEL_KEY) and torch.all(v_ws[..., -1, :] == 0)


def test_key_only_sentinel_breaks_the_model_where_the_mask_does_not(llama, session):
    ref, unmasked = reference(llama, session), sentinel_run(llama, session, mask_sentinel=False)
    assert (ref[-1] - unmasked[-1]).abs().max() > 1e-2


# (d) residual head at initialisation
def test_residual_head_is_exactly_zero_at_init(session):
    k, q = session["k_all"], session["q_all"]
    head = ResidualHead(n_layers=2, n_heads=4, head_dim=16)
    plain, with_head = IntentKV(), IntentKV(residual=head)
    s0, r0, m0 = plain.score(k, q[:, :, T_HIST:])
    s1, r1, m1 = with_head.score(k, q[:, :, T_HIST:])
    assert torch.equal(s0, s1) and torch.equal(r0, r1) and torch.equal(m0, m1)
    assert torch.equal(head(k, k[:, :, T_HIST:], r0, m0), torch.zeros(k.shape[2]))
    # trainable: one step moves it off zero
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    s, _, _ = with_head.score(k, q[:, :, T_HIST:])
    (-s[:10].sum()).backward()
    opt.step()
    assert not torch.equal(with_head.score(k, q[:, :, T_HIST:])[0], s0)


def test_prune_on_real_kv_both_layouts(session):
    k, v, q = session["k_all"], session["v_all"], session["q_all"]
    T = k.shape[2]
    protected = torch.zeros(T, dtype=torch.bool)
    protected[:SYS] = protected[T_HIST:] = True
    ikv = IntentKV()
    comp = ikv.prune(k, v, q[:, :, T_HIST:], 30, protected, "compaction")
    sent = ikv.prune(k, v, q[:, :, T_HIST:], 30, protected, "sentinel", memory=None)
    assert torch.equal(comp.keep, sent.keep) and comp.n_kept == 30 and bool(comp.keep[protected].all())
    assert comp.keys.shape == (2, 4, 30, 16) and torch.equal(comp.index, comp.keep.nonzero().squeeze(-1))
    assert sent.keys.shape == (2, 4, T + 1, 16) and sent.index.shape == (T,)
    assert torch.equal(sent.index[sent.keep], torch.arange(T)[sent.keep]) and bool((sent.index[~sent.keep] == T).all())
    nxt = ikv.prune(k, v, q[:, :, T_HIST:], 30, protected, "sentinel", memory=sent.memory)
    assert torch.allclose(nxt.memory, math.exp(-0.5) * sent.memory + encode_span(q[:, :, T_HIST:]))


# ----------------------------------------------------------------------------- memory and rule score

def test_update_memory_decays_by_exp_minus_half():
    m = torch.randn(2, 3, 8)
    enc = torch.zeros(2, 3, 8)
    assert torch.allclose(update_memory(m, enc), math.exp(-0.5) * m)
    assert torch.allclose(update_memory(m, enc, lam=1.0), math.exp(-1.0) * m)
    e = torch.randn(2, 3, 8)
    assert torch.equal(update_memory(None, e), e)
    assert torch.allclose(update_memory(m, e), math.exp(-0.5) * m + e)


def test_encode_span_is_unit_mean_direction():
    q = torch.randn(2, 3, 5, 8)
    enc = encode_span(q)
    assert enc.shape == (2, 3, 8)
    assert torch.allclose(enc.norm(dim=-1), torch.ones(2, 3), atol=1e-6)
    assert torch.allclose(enc, q.mean(2) / q.mean(2).norm(dim=-1, keepdim=True), atol=1e-6)


def test_rule_scores_is_a_sum_of_softmaxes_and_supports_gqa():
    mem, keys = torch.randn(2, 4, 8), torch.randn(2, 4, 10, 8)
    s = rule_scores(mem, keys)
    assert s.shape == (10,) and torch.isclose(s.sum(), torch.tensor(8.0))
    manual = sum(torch.softmax(keys[l, h] @ mem[l, h] / math.sqrt(8), 0) for l in range(2) for h in range(4))
    assert torch.allclose(s, manual, atol=1e-6)
    grouped = keys[:, ::2]                                             # 2 KV heads shared by 4 query heads
    assert torch.allclose(rule_scores(mem, grouped), rule_scores(mem, grouped.repeat_interleave(2, 1)))
    aligned = keys.clone()
    aligned[:, :, 3] = mem * 10
    assert int(rule_scores(mem, aligned).argmax()) == 3


# ----------------------------------------------------------------------------- selection

def test_select_keep_budget_protected_and_ties():
    scores = torch.tensor([5.0, 1.0, 1.0, 3.0, 1.0, 0.0])
    protected = torch.tensor([True, False, False, False, False, True])
    keep = select_keep(scores, 4, protected)
    assert keep.tolist() == [True, False, False, True, True, True]     # tie among 1.0s -> latest (index 4)
    assert select_keep(scores, 1, protected).tolist() == protected.tolist()   # protected alone exceed
    assert bool(select_keep(scores, 100, protected).all())
    assert select_keep(torch.tensor([float("nan"), 0.0]), 1, torch.zeros(2, dtype=torch.bool)).tolist() == [False, True]
    with pytest.raises(ValueError):
        select_keep(scores, -1, protected)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40).flatmap(lambda t: st.tuples(
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=t, max_size=t),
    st.lists(st.booleans(), min_size=t, max_size=t), st.integers(0, 45))))
def test_select_keep_properties(args):
    scores, prot, budget = torch.tensor(args[0]), torch.tensor(args[1]), args[2]
    keep = select_keep(scores, budget, prot)
    n_prot = int(prot.sum())
    assert bool(keep[prot].all())
    assert int(keep.sum()) == (n_prot if n_prot >= budget else min(budget, len(args[0])))
    if (keep & ~prot).any() and (~keep).any():                         # every kept other >= every dropped
        assert float(scores[keep & ~prot].min()) >= float(scores[~keep].max())


def test_layouts():
    k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    keep = torch.tensor([True, False, True, False, False, True])
    kc, vc, pos = compact(k, v, keep)
    assert kc.shape == (2, 3, 3, 4) and pos.tolist() == [0, 2, 5] and torch.equal(vc, v[:, :, [0, 2, 5]])
    ks, vs, slot = sentinel_layout(k, v, keep)
    assert ks.shape == (2, 3, 7, 4) and slot.tolist() == [0, 6, 2, 6, 6, 5] and slot.dtype == torch.long
    assert torch.equal(ks[:, :, :6], k) and bool((ks[:, :, 6] == -1e4).all()) and bool((vs[:, :, 6] == 0).all())
    assert sentinel_bias(slot).tolist() == [0.0, -math.inf, 0.0, -math.inf, -math.inf, 0.0]
    for layout in LAYOUTS:
        assert len(apply_layout(k, v, keep, layout)) == 3
    with pytest.raises(ValueError):
        apply_layout(k, v, keep, "nope")


# ----------------------------------------------------------------------------- baselines

def test_streaming_llm_keeps_sinks_and_recent_window():
    s = streaming_llm_scores(20, sink=4)
    keep = select_keep(s, 4 + 6, torch.zeros(20, dtype=torch.bool))
    assert keep.nonzero().squeeze(-1).tolist() == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]
    assert streaming_llm_scores(3, sink=4).shape == (3,)


def test_h2o_accumulates_attention():
    q, k = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    attn = causal_attention(q, k)
    assert attn.shape == (2, 3, 10, 10) and torch.allclose(attn.sum(-1), torch.ones(2, 3, 10), atol=1e-6)
    assert bool((attn.triu(1) == 0).all())
    s = h2o_scores(attn)
    assert s.shape == (10,) and torch.isclose(s.sum(), torch.tensor(60.0))
    heavy = torch.full((1, 1, 4, 6), 0.02)
    heavy[..., 2] = 0.9
    assert int(h2o_scores(heavy).argmax()) == 2


def test_snapkv_window_votes_and_pooling():
    k = torch.randn(1, 2, 30, 8) * 0.1
    w = torch.randn(1, 2, 4, 8)
    k[:, :, 7] = w.mean(2) * 20                                        # the window looks at position 7
    s1 = snapkv_scores(w, k, kernel_size=1, causal=False)
    assert s1.shape == (30,) and int(s1.argmax()) == 7 and torch.isclose(s1.sum(), torch.tensor(8.0))
    s5 = snapkv_scores(w, k, kernel_size=5, causal=False)
    assert bool((s5[5:10] >= s1[7] - 1e-6).all())                     # max-pooled onto neighbours
    sc = snapkv_scores(w, k, kernel_size=1, causal=True)               # window = last 4 positions
    assert sc.shape == (30,) and torch.isclose(sc.sum(), torch.tensor(8.0))
    assert snapkv_scores(w, k, pool="avg").shape == (30,)


def test_scores_for_dispatches_every_method():
    q, k = torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
    span = q[:, :, -3:]
    got = {m: scores_for(m, k, span_queries=span, queries=q) for m in METHODS}
    assert all(s.shape == (12,) for s in got.values())
    assert torch.allclose(got["intent"], rule_scores(encode_span(span), k))
    assert torch.allclose(got["h2o"], h2o_scores(causal_attention(q, k)))
    assert torch.allclose(got["snapkv"], snapkv_scores(span, k))
    assert torch.equal(got["streaming_llm"], streaming_llm_scores(12))
    mem = torch.randn(2, 4, 8)
    assert torch.allclose(scores_for("intent", k, memory=mem), rule_scores(mem, k))
    with pytest.raises(ValueError):
        scores_for("lru", k)
    with pytest.raises(ValueError):
        scores_for("h2o", k)
