"""IntentKV: prune a long agent context to a KV budget, two layouts (docs/intentkv.md; arXiv 2606.09916).

Shapes follow one convention throughout: per-layer, per-head tensors are stacked as
``[L, H, T, D]`` (layers, heads, positions, head dim); a score vector is ``[T]``; a
``keep`` mask is a bool ``[T]``. Nothing here depends on a particular model: the keys,
values and queries are whatever the serving model wrote (post-RoPE).

Scoring (the intent-memory rule, arXiv 2606.09916)::

    Enc(q_t)^{l,h} = mean_s Q^{l,h}_s / || mean_s Q^{l,h}_s ||          (latest user/tool span)
    M_t            = exp(-lam) * M_{t-1} + Enc(q_t)
    score_j        = sum_{l,h} softmax_j( M_t^{l,h} . K^{l,h}_j / sqrt(D) )
                     (+ ResidualHead correction, exactly 0 at initialisation)

Selection keeps every protected token (system prefix, latest span) and the top
``budget - #protected`` others. Layouts:

* compaction: the dropped rows are removed, so every later token moves to a smaller
  position (and slot): RoPE phases and the radix-tree key no longer line up.
* sentinel slots: one extra slot ``T`` with ``K = -1e4 * 1`` and ``V = 0``; every dropped
  position points at it, survivors keep their position and slot.

Caveat found by the tests: a sentinel *key* alone does not give ~0 weight for *every*
query, since ``q . (-1e4 * 1) = -1e4 * sum(q)`` is a huge *positive* logit whenever the
components of ``q`` sum to a negative number (about half of the heads of a real model).
The exact, query-independent way is to mask the sentinel slot (``sentinel_bias``), as
``slot_attention(..., mask_sentinel=True)`` does; then its weight is exactly 0 and the
output over the slot table equals attention over the kept tokens at their original positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

METHODS = ("intent", "streaming_llm", "h2o", "snapkv")
LAYOUTS = ("compaction", "sentinel")
SENTINEL_KEY = -1e4

__all__ = ["LAYOUTS", "METHODS", "SENTINEL_KEY", "IntentKV", "PruneResult", "ResidualHead", "apply_layout",
           "causal_attention", "compact", "encode_span", "h2o_scores", "rope_rotate", "rule_scores",
           "scores_for", "select_keep", "sentinel_bias", "sentinel_layout", "slot_attention",
           "snapkv_scores", "streaming_llm_scores", "update_memory"]


# ----------------------------------------------------------------------------- helpers

def _match_heads(keys: Tensor, n_query_heads: int) -> Tensor:
    """Repeat grouped KV heads (GQA) so that ``keys`` has ``n_query_heads`` heads (dim 1)."""
    n_kv = keys.shape[1]
    if n_kv == n_query_heads:
        return keys
    if n_query_heads % n_kv:
        raise ValueError(f"{n_query_heads} query heads are not a multiple of {n_kv} KV heads")
    return keys.repeat_interleave(n_query_heads // n_kv, dim=1)


def _check_stack(name: str, x: Tensor, ndim: int) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")


# ----------------------------------------------------------------------------- intent memory

def encode_span(span_queries: Tensor) -> Tensor:
    r"""Encode the latest user/tool span.

    .. math::
        \mathrm{Enc}(q_t)^{l,h} = \frac{\bar q^{l,h}}{\lVert \bar q^{l,h} \rVert_2},\qquad
        \bar q^{l,h} = \frac{1}{S}\sum_{s=1}^{S} Q^{l,h}_s

    Args:
        span_queries: ``[L, H, S, D]`` post-RoPE queries of the span's tokens.
    Returns:
        ``[L, H, D]``, unit norm per (layer, head).
    """
    _check_stack("span_queries", span_queries, 4)
    if span_queries.shape[2] == 0:
        raise ValueError("the latest span has no tokens")
    return F.normalize(span_queries.float().mean(dim=2), dim=-1, eps=1e-12)


def update_memory(memory: Tensor | None, enc: Tensor, lam: float = 0.5) -> Tensor:
    r"""Session memory :math:`M_t = e^{-\lambda} M_{t-1} + \mathrm{Enc}(q_t)`, with :math:`M_0 = 0`.

    Args:
        memory: ``[L, H, D]`` or ``None`` (first turn: the result is ``enc``).
        enc: ``[L, H, D]`` from :func:`encode_span`.
        lam: decay rate :math:`\lambda` (0.5 in the paper).
    """
    if memory is None:
        return enc.clone()
    if memory.shape != enc.shape:
        raise ValueError(f"memory {tuple(memory.shape)} and enc {tuple(enc.shape)} differ in shape")
    return math.exp(-lam) * memory + enc


def rule_scores(memory: Tensor, keys: Tensor) -> Tensor:
    r"""Intent rule score of every position.

    .. math::
        s_j = \sum_{l=1}^{L}\sum_{h=1}^{H}
              \mathrm{softmax}_j\!\left(\frac{M^{l,h}\cdot K^{l,h}_j}{\sqrt{D}}\right)

    Args:
        memory: ``[L, H, D]``.
        keys: ``[L, H_kv, T, D]`` post-RoPE keys (``H_kv`` divides ``H``; grouped heads are repeated).
    Returns:
        ``[T]``, each in ``[0, L*H]``, summing to ``L*H``.
    """
    _check_stack("memory", memory, 3)
    _check_stack("keys", keys, 4)
    keys = _match_heads(keys, memory.shape[1]).float()
    logits = torch.einsum("lhd,lhtd->lht", memory.float(), keys) / math.sqrt(keys.shape[-1])
    return logits.softmax(dim=-1).sum(dim=(0, 1))


# ----------------------------------------------------------------------------- residual head

class ResidualHead(nn.Module):
    r"""Learned correction :math:`r_j` added to the rule score: :math:`s_j = s^{rule}_j + \alpha\, r_j`.

    Per history token :math:`j` (keys flattened over layers and heads, :math:`x_j \in \mathbb{R}^{LHD}`):

    .. math::
        h_j &= W_x\,\mathrm{LN}(x_j), \qquad g_s = \mathrm{LN}(y_s)\ \text{(keys of the current query's span)}\\
        c_j &= \sum_s \mathrm{softmax}_s\!\left(\frac{(W_q h_j)\cdot(W_k g_s)}{\sqrt{d}}\right) W_v g_s
              \quad\text{(small cross-attention)}\\
        z_j &= \big[h_j,\ c_j,\ \log(T p^{l,h}_j)_{l,h},\ \log(T s^{rule}_j / LH),\ j/T\big]\\
        r_j &= w_2^\top \mathrm{GELU}(W_1 z_j + b_1) + b_2

    with :math:`p^{l,h}_j = \mathrm{softmax}_j(M^{l,h}\cdot K^{l,h}_j/\sqrt{D})`. :math:`w_2, b_2` start at 0,
    so the correction is exactly 0 at initialisation (and :math:`\alpha = 1`).
    """

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, d_model: int = 32, hidden: int = 64,
                 alpha: float = 1.0):
        super().__init__()
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.d_model, self.hidden, self.alpha = d_model, hidden, alpha
        flat = n_layers * n_heads * head_dim
        self.norm = nn.LayerNorm(flat, elementwise_affine=False)
        self.proj = nn.Linear(flat, d_model)
        self.span_proj = nn.Linear(flat, d_model)
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        n_feat = 2 * d_model + n_layers * n_heads + 2
        self.mlp = nn.Sequential(nn.Linear(n_feat, hidden), nn.GELU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def config(self) -> dict:
        return {"n_layers": self.n_layers, "n_heads": self.n_heads, "head_dim": self.head_dim,
                "d_model": self.d_model, "hidden": self.hidden, "alpha": self.alpha}

    def _flat(self, x: Tensor) -> Tensor:
        """``[L, H, T, D]`` -> ``[T, L*H*D]``, layer-normalised."""
        L, H, T, D = x.shape
        return self.norm(x.float().permute(2, 0, 1, 3).reshape(T, L * H * D))

    def features(self, keys: Tensor, span_keys: Tensor, rule: Tensor, memory: Tensor | None,
                 positions: Tensor | None = None) -> Tensor:
        """The MLP input ``z`` of every position (or of ``positions`` only): ``[T or P, 2d + L*H + 2]``.
        A position's ``z`` depends on the others only through the softmax over all ``T`` keys, so a
        subset gives exactly the rows of the full result."""
        T = keys.shape[2]
        idx = torch.arange(T, device=keys.device) if positions is None else positions
        h = self.proj(self._flat(keys[:, :, idx] if positions is not None else keys))   # [P, d]
        g = self.span_proj(self._flat(span_keys))                          # [S, d]
        att = (self.wq(h) @ self.wk(g).T / math.sqrt(self.d_model)).softmax(dim=-1)
        c = att @ self.wv(g)                                               # [P, d]
        if memory is None:
            head_logp = keys.new_zeros(idx.numel(), self.n_layers * self.n_heads, dtype=torch.float32)
        else:
            k = _match_heads(keys, memory.shape[1]).float()
            logits = torch.einsum("lhd,lhtd->lht", memory.float(), k) / math.sqrt(k.shape[-1])
            head_logp = (logits.log_softmax(dim=-1) + math.log(T)).reshape(-1, T).T[idx]
        rule_feat = torch.log(rule.float()[idx] * T / (self.n_layers * self.n_heads) + 1e-6)
        pos = idx.float() / max(T, 1)
        z = torch.cat([h, c, head_logp, rule_feat[:, None], pos[:, None]], dim=-1)
        return z.clamp(-30.0, 30.0)                                        # finite: 0 * z stays 0

    def forward(self, keys: Tensor, span_keys: Tensor, rule: Tensor, memory: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        """Correction ``[T]`` for ``keys [L, H, T, D]`` (``[P]`` for ``positions [P]`` only), given the
        span's keys ``[L, H, S, D]``, the rule score ``[T]`` and the memory ``[L, H, D]``."""
        return self.alpha * self.mlp(self.features(keys, span_keys, rule, memory, positions)).squeeze(-1)


# ----------------------------------------------------------------------------- baselines

def streaming_llm_scores(n_tokens: int, sink: int = 4) -> Tensor:
    r"""StreamingLLM ranking: attention sinks first, then recency.

    :math:`s_j = j + T\,[j < \text{sink}]`. With :func:`select_keep` and ``budget = sink + w``
    (nothing protected) it keeps the first ``sink`` tokens and the last ``w``.
    """
    if n_tokens < 0 or sink < 0:
        raise ValueError("n_tokens and sink must be >= 0")
    scores = torch.arange(n_tokens, dtype=torch.float32)
    scores[: min(sink, n_tokens)] += n_tokens
    return scores


def causal_attention(queries: Tensor, keys: Tensor) -> Tensor:
    r"""Softmax attention weights ``[L, H, Q, T]`` of queries occupying the *last* ``Q`` positions
    of the ``T`` keys (query ``i`` is at position :math:`T - Q + i` and sees keys :math:`\le` it)."""
    _check_stack("queries", queries, 4)
    _check_stack("keys", keys, 4)
    keys = _match_heads(keys, queries.shape[1]).float()
    Q, T = queries.shape[2], keys.shape[2]
    logits = torch.einsum("lhqd,lhtd->lhqt", queries.float(), keys) / math.sqrt(keys.shape[-1])
    q_pos = torch.arange(Q, device=keys.device) + (T - Q)
    future = torch.arange(T, device=keys.device)[None, :] > q_pos[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


def h2o_scores(attention: Tensor) -> Tensor:
    r"""H2O heavy hitters: accumulated attention :math:`s_j = \sum_{l,h,i} A^{l,h}_{i,j}`.

    Args:
        attention: ``[L, H, Q, T]`` attention weights (e.g. :func:`causal_attention`).
    """
    _check_stack("attention", attention, 4)
    return attention.float().sum(dim=(0, 1, 2))


def snapkv_scores(window_queries: Tensor, keys: Tensor, kernel_size: int = 5, pool: str = "max",
                  causal: bool = True) -> Tensor:
    r"""SnapKV: attention of an observation window's queries, summed over the window, pooled.

    .. math::
        v^{l,h}_j = \mathrm{pool}_{|j'-j|\le \lfloor k/2\rfloor}
                    \sum_{w} \mathrm{softmax}_{j'}\!\left(\frac{Q^{l,h}_w\cdot K^{l,h}_{j'}}{\sqrt D}\right),
        \qquad s_j = \sum_{l,h} v^{l,h}_j

    Args:
        window_queries: ``[L, H, W, D]`` (e.g. the latest span's queries).
        keys: ``[L, H_kv, T, D]``.
        kernel_size: pooling width (1 = no pooling; odd).
        pool: ``"max"`` or ``"avg"``.
        causal: the window occupies the last ``W`` key positions (mask what lies after each query);
            ``False``: the window follows the keys and sees all of them.
    """
    if causal:
        attn = causal_attention(window_queries, keys)
    else:
        k = _match_heads(keys, window_queries.shape[1]).float()
        attn = (torch.einsum("lhwd,lhtd->lhwt", window_queries.float(), k) / math.sqrt(k.shape[-1])).softmax(-1)
    votes = attn.sum(dim=2)                                                # [L, H, T]
    if kernel_size > 1 and votes.shape[-1] > 0:
        if kernel_size % 2 == 0:
            raise ValueError("kernel_size must be odd")
        L, H, T = votes.shape
        flat = votes.reshape(L * H, 1, T)
        if pool == "max":
            flat = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
        elif pool == "avg":
            flat = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=False)
        else:
            raise ValueError(f"pool must be 'max' or 'avg', got {pool!r}")
        votes = flat.reshape(L, H, T)
    return votes.sum(dim=(0, 1))


def scores_for(method: str, keys: Tensor, *, memory: Tensor | None = None, span_queries: Tensor | None = None,
               attention: Tensor | None = None, queries: Tensor | None = None,
               window_queries: Tensor | None = None, sink: int = 4, kernel_size: int = 5) -> Tensor:
    """Scores ``[T]`` of ``keys [L, H, T, D]`` by ``method`` (one of :data:`METHODS`).

    * ``intent``: :func:`rule_scores` with ``memory`` = the current :math:`M_t` (already updated with the
      latest span); without one, :math:`M_t = \\mathrm{Enc}(q_t)` from ``span_queries``.
    * ``streaming_llm``: :func:`streaming_llm_scores` (needs only ``T``).
    * ``h2o``: :func:`h2o_scores` of ``attention [L, H, Q, T]``, or of :func:`causal_attention` of
      ``queries`` (the last ``Q`` positions' queries).
    * ``snapkv``: :func:`snapkv_scores` of ``window_queries`` (default: ``span_queries``), causal.
    """
    if method == "intent":
        if memory is None:
            if span_queries is None:
                raise ValueError("intent needs memory or span_queries")
            memory = encode_span(span_queries)
        return rule_scores(memory, keys)
    if method == "streaming_llm":
        return streaming_llm_scores(keys.shape[-2], sink)
    if method == "h2o":
        if attention is None:
            if queries is None:
                raise ValueError("h2o needs attention or queries")
            attention = causal_attention(queries, keys)
        return h2o_scores(attention)
    if method == "snapkv":
        window = window_queries if window_queries is not None else span_queries
        if window is None:
            raise ValueError("snapkv needs window_queries or span_queries")
        return snapkv_scores(window, keys, kernel_size=kernel_size)
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


# ----------------------------------------------------------------------------- selection and layouts

def select_keep(scores: Tensor, budget: int, protected: Tensor) -> Tensor:
    """Bool ``[T]``: every protected token, plus the ``budget - #protected`` highest-scoring others.

    Ties go to the later position; NaN scores rank last. If the protected tokens alone reach the
    budget, exactly the protected tokens are kept (the budget is then exceeded, never a protected
    token dropped). ``budget >= T`` keeps everything.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if scores.dim() != 1 or protected.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and protected {tuple(protected.shape)} must both be [T]")
    keep = protected.bool().clone()
    n_free = budget - int(keep.sum())
    if n_free <= 0:
        return keep
    cand = (~keep).nonzero().squeeze(-1)                                   # ascending positions
    if n_free >= cand.numel():
        keep[cand] = True
        return keep
    rev = cand.flip(0)                                                     # later positions first ...
    s = scores[rev].float().nan_to_num(nan=float("-inf"))
    order = torch.argsort(s, descending=True, stable=True)                 # ... so ties favour them
    keep[rev[order[:n_free]]] = True
    return keep


def compact(keys: Tensor, values: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Compaction layout: remove dropped rows. Returns ``(keys[..., keep, :], values[..., keep, :],
    positions)`` where ``positions [n_kept]`` are the survivors' original positions; survivor ``i``
    now sits at position (and slot) ``i``."""
    keep = keep.bool()
    return keys[..., keep, :], values[..., keep, :], keep.nonzero().squeeze(-1)


def sentinel_layout(keys: Tensor, values: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sentinel-slot layout: append one slot ``T`` with ``K = -1e4 * 1`` and ``V = 0``.

    Returns ``(keys_ws [..., T+1, D], values_ws [..., T+1, D], slot_of_position [T] long)`` with
    ``slot_of_position[j] = j`` if ``keep[j]`` else ``T``: survivors keep their position and slot,
    so the token sequence (and the radix-tree key) is unchanged.
    """
    keep = keep.bool()
    T = keys.shape[-2]
    if keep.shape != (T,):
        raise ValueError(f"keep must be [T={T}], got {tuple(keep.shape)}")
    k_sent = torch.full((*keys.shape[:-2], 1, keys.shape[-1]), SENTINEL_KEY, dtype=keys.dtype, device=keys.device)
    v_sent = torch.zeros((*values.shape[:-2], 1, values.shape[-1]), dtype=values.dtype, device=values.device)
    slot = torch.where(keep, torch.arange(T, device=keep.device), torch.full_like(keep, T, dtype=torch.long))
    return torch.cat([keys, k_sent], dim=-2), torch.cat([values, v_sent], dim=-2), slot


def apply_layout(keys: Tensor, values: Tensor, keep: Tensor, layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`compact` or :func:`sentinel_layout` by name (one of :data:`LAYOUTS`)."""
    if layout == "compaction":
        return compact(keys, values, keep)
    if layout == "sentinel":
        return sentinel_layout(keys, values, keep)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def sentinel_bias(slot_of_position: Tensor, sentinel_slot: int | None = None) -> Tensor:
    """Additive attention bias ``[T]``: ``-inf`` at positions mapped to the sentinel slot, else 0.

    ``sentinel_slot`` defaults to ``T`` (as :func:`sentinel_layout` lays it out)."""
    slot = sentinel_slot if sentinel_slot is not None else slot_of_position.shape[-1]
    zero = torch.zeros(slot_of_position.shape, dtype=torch.float32, device=slot_of_position.device)
    return zero.masked_fill(slot_of_position == slot, float("-inf"))


def slot_attention(queries: Tensor, keys_ws: Tensor, values_ws: Tensor, slot_of_position: Tensor,
                   query_positions: Tensor, mask_sentinel: bool = True,
                   return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    r"""Attention of ``queries [..., Q, D]`` over a slot table, as a paged kernel reads it.

    Position :math:`j` reads slot :math:`\sigma(j)`;
    :math:`o_i = \sum_{j \le p_i} \mathrm{softmax}_j(q_i\cdot K_{\sigma(j)}/\sqrt D + b_j)\, V_{\sigma(j)}`
    with :math:`b_j = -\infty` on sentinel-mapped positions when ``mask_sentinel`` (else 0, the
    key-only sentinel). ``query_positions [Q]`` are the queries' absolute positions (causal mask).
    Returns the output ``[..., Q, D]`` (and the weights ``[..., Q, T]``).
    """
    k = keys_ws[..., slot_of_position, :].float()
    v = values_ws[..., slot_of_position, :].float()
    logits = queries.float() @ k.transpose(-1, -2) / math.sqrt(k.shape[-1])
    T = slot_of_position.shape[-1]
    future = torch.arange(T, device=k.device)[None, :] > query_positions[:, None]
    logits = logits.masked_fill(future, float("-inf"))
    if mask_sentinel:
        logits = logits + sentinel_bias(slot_of_position, keys_ws.shape[-2] - 1)
    weights = logits.softmax(dim=-1).nan_to_num(0.0)
    out = weights @ v
    return (out, weights) if return_weights else out


def rope_rotate(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    r"""Rotate ``x [..., N, D]`` by RoPE angles :math:`\theta_{n,i} = p_n \omega_i` (rotate-half
    convention of Llama/Qwen; ``positions [N]`` may be negative). Since rotations compose,
    ``rope_rotate(k, new - old, inv_freq)`` re-encodes a key from position ``old`` to ``new``."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------- module

@dataclass
class PruneResult:
    """What :meth:`IntentKV.prune` returns.

    ``index`` is the layout's third tensor: the survivors' original positions (compaction) or
    ``slot_of_position [T]`` (sentinel)."""

    keep: Tensor            # bool [T]
    keys: Tensor            # compaction [L, H, n_kept, D]; sentinel [L, H, T+1, D]
    values: Tensor
    index: Tensor
    layout: str
    memory: Tensor          # M_t [L, H, D]: pass it to the next prune of the session
    scores: Tensor          # [T] rule (+ residual)
    rule: Tensor            # [T] rule score alone

    @property
    def n_kept(self) -> int:
        return int(self.keep.sum())


class IntentKV(nn.Module):
    """Intent-memory scoring + selection + layout.

    ``prune`` updates the session memory with the latest span, scores every position, keeps the
    protected ones and the top others up to ``budget``, and lays the result out. Convention: the
    latest span is the last ``S`` positions of ``keys`` (``S = span_queries.shape[2]``), whose keys
    the residual head cross-attends to, unless ``span_keys`` is given.
    """

    def __init__(self, lam: float = 0.5, residual: ResidualHead | None = None):
        super().__init__()
        self.lam = lam
        self.residual = residual

    def score(self, keys: Tensor, span_queries: Tensor, memory: Tensor | None = None,
              span_keys: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(scores [T], rule [T], M_t [L, H, D])``, differentiable through the residual head."""
        new_memory = update_memory(memory, encode_span(span_queries), self.lam)
        rule = rule_scores(new_memory, keys)
        if self.residual is None:
            return rule, rule, new_memory
        if span_keys is None:
            span_keys = keys[:, :, keys.shape[2] - span_queries.shape[2]:]
        return rule + self.residual(keys, span_keys, rule, new_memory), rule, new_memory

    @torch.no_grad()
    def prune(self, keys: Tensor, values: Tensor, span_queries: Tensor, budget: int, protected: Tensor,
              layout: str, memory: Tensor | None = None, span_keys: Tensor | None = None) -> PruneResult:
        """Prune ``keys``/``values [L, H, T, D]`` to ``budget`` tokens in ``layout`` (see :data:`LAYOUTS`)."""
        scores, rule, new_memory = self.score(keys, span_queries, memory, span_keys)
        keep = select_keep(scores, budget, protected)
        k, v, index = apply_layout(keys, values, keep, layout)
        return PruneResult(keep=keep, keys=k, values=v, index=index, layout=layout, memory=new_memory,
                           scores=scores, rule=rule)
