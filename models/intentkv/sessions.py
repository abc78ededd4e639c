"""Text-bearing agent sessions, token labels and K/Q features for the IntentKV residual head.

Labels (docs/intentkv.md; arXiv 2606.09916): at the decision point before tool call ``c``, a history token is
positive if it appears literally in the arguments of calls ``c .. c+4``. "Literally" is taken at
the word level of the tokenizer: the token's pre-tokenized word (normalised, lower-cased) is one
of the words of those calls' argument *values*; punctuation-only words never count.

Session ``i`` of seed ``s`` is drawn from its own generator seeded ``(s, i)``, so the first ``n``
sessions do not depend on how many are drawn. Tool calls copy entities (order ids, e-mail
addresses, names, files, amounts) that the user or earlier tool results mentioned, mostly recent
ones, among distractor entities and filler text.

:func:`build_examples` lays out every decision point with the queries and keys of MiniLM
(:mod:`models.intentkv.minilm`) and the scores of the methods that learn nothing. The small randomly
initialised Llama (:func:`tiny_llama`, :func:`capture_qkv`: post-RoPE queries, keys and values of
a causal model) serves the layout-equivalence tests (tests/models/test_intentkv.py).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

# ----------------------------------------------------------------------------- tiny model


def tiny_llama(vocab_size: int, seed: int = 0, hidden_size: int = 64, n_layers: int = 2, n_heads: int = 4,
               n_kv_heads: int | None = None, max_positions: int = 4096, init_range: float = 0.02,
               attn_implementation: str = "eager"):
    """A randomly initialised ``LlamaForCausalLM`` (eval mode) from a config; nothing is downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=n_layers, num_attention_heads=n_heads,
                         num_key_value_heads=n_kv_heads or n_heads, max_position_embeddings=max_positions,
                         initializer_range=init_range, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def capture_qkv(model, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Post-RoPE ``(queries [L, H, T, D], keys [L, H_kv, T, D], values [L, H_kv, T, D])`` of one sequence.

    Keys and values are the model's own KV cache; queries are recomputed from each attention
    module's input with its ``q_proj`` and the modeling file's ``apply_rotary_pos_emb`` (a forward
    pre-hook), exactly as the module computes them.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    rope = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    queries: list[Tensor] = []

    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
        queries.append(rope(q, q, cos, sin)[0][0])

    layers = getattr(model, "model", model).layers
    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        base = getattr(model, "model", model)                  # skip the LM head: K/Q/V are all we need
        cache = base(input_ids, use_cache=True).past_key_values
    finally:
        for h in handles:
            h.remove()
    keys = torch.stack([cache.layers[i].keys[0] for i in range(len(layers))])
    values = torch.stack([cache.layers[i].values[0] for i in range(len(layers))])
    return torch.stack(queries), keys, values


# ----------------------------------------------------------------------------- sessions

SYSTEM = ("system: You are an operations assistant for an online shop. Use the tools to resolve the "
          "user's request. Tools: lookup_customer(email), search_orders(customer, city), get_order(order_id), "
          "read_file(path), refund(order_id, amount), send_email(to, subject), create_ticket(customer, summary). "
          "Call one tool per turn with JSON arguments.")

FIRST = ["maria", "james", "aiko", "omar", "lena", "pavel", "grace", "diego", "fatima", "noah", "ines", "tariq",
         "elena", "victor", "sofia", "kwame", "hannah", "luca", "priya", "marco"]
LAST = ["lopez", "smith", "tanaka", "haddad", "berg", "novak", "okafor", "rossi", "khan", "meyer", "silva",
        "dubois", "kowalski", "nguyen", "andersen", "moreau", "petrov", "costa", "fischer", "osei"]
CITIES = ["lisbon", "denver", "osaka", "nairobi", "krakow", "toronto", "lyon", "austin", "porto", "leeds",
          "munich", "dublin", "seville", "oslo", "tucson"]
PRODUCTS = ["kettle", "backpack", "headphones", "desk lamp", "blender", "yoga mat", "router", "monitor",
            "coffee grinder", "rain jacket", "keyboard", "water bottle"]
TOPICS = ["invoice", "receipt", "shipping", "warranty", "statement", "manifest", "returns"]
EXTS = ["pdf", "csv", "txt", "xlsx"]
DOMAINS = ["example.com", "mailbox.org", "shopmail.net", "corp.io"]
STATUSES = ["shipped", "delivered", "delayed", "returned", "processing", "lost in transit"]
FILLER = [
    "The system processed the request and wrote an entry to the audit log.",
    "Please note that response times may vary during the holiday season.",
    "All amounts are shown including tax unless stated otherwise.",
    "This record was last synchronised with the warehouse database this morning.",
    "Customer satisfaction surveys are sent automatically after each resolution.",
    "Refunds usually appear on the original payment method within five business days.",
    "The courier updates tracking information twice a day.",
    "Our policy allows returns within thirty days of delivery.",
    "Internal note: double check the address before any reshipment.",
    "Thank you for your patience while we look into this.",
]

TOOLS = {  # tool -> (argument name, entity kind) in order
    "lookup_customer": [("email", "email")],
    "search_orders": [("customer", "name"), ("city", "city")],
    "get_order": [("order_id", "order")],
    "read_file": [("path", "file")],
    "refund": [("order_id", "order"), ("amount", "amount")],
    "send_email": [("to", "email"), ("subject", "order")],
    "create_ticket": [("customer", "name"), ("summary", "product")],
}


@dataclass
class Message:
    role: str                       # system | user | assistant | tool
    text: str
    tool: str | None = None         # assistant tool calls only
    args: dict | None = None


@dataclass
class Session:
    session_id: str
    messages: list[Message]


class _Entities:
    """Entities known so far in a session, newest last, with a random source for fresh ones."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.known: dict[str, list[str]] = {}

    def fresh(self, kind: str) -> str:
        r = self.rng
        if kind == "order":
            return f"ORD-{r.integers(10000, 99999)}"
        if kind == "email":
            return f"{r.choice(FIRST)}.{r.choice(LAST)}@{r.choice(DOMAINS)}"
        if kind == "name":
            return f"{r.choice(FIRST).title()} {r.choice(LAST).title()}"
        if kind == "city":
            return str(r.choice(CITIES)).title()
        if kind == "file":
            return f"{r.choice(TOPICS)}_{r.integers(1000, 99999)}.{r.choice(EXTS)}"
        if kind == "amount":
            return f"{r.integers(5, 900)}.{r.integers(0, 100):02d}"
        if kind == "product":
            return str(r.choice(PRODUCTS))
        if kind == "ticket":
            return f"TCK{r.integers(1000, 9999)}"
        raise ValueError(kind)

    def mention(self, kind: str) -> str:
        """A fresh entity that now counts as known (it is about to appear in the text)."""
        value = self.fresh(kind)
        self.known.setdefault(kind, []).append(value)
        return value

    def pick(self, kind: str) -> str:
        """An argument value: mostly the most recent known entity of the kind, sometimes an older
        one, and a fresh one (never seen: no positives) when none is known or rarely by chance."""
        pool = self.known.get(kind, [])
        u = self.rng.random()
        if not pool or u < 0.08:
            return self.fresh(kind)
        if u < 0.65 or len(pool) == 1:
            return pool[-1]
        return pool[int(self.rng.integers(0, len(pool) - 1))]


def _filler(rng: np.random.Generator, lo: int, hi: int) -> str:
    return " ".join(rng.choice(FILLER, size=int(rng.integers(lo, hi + 1)), replace=True))


def _user_text(ent: _Entities, rng: np.random.Generator, first: bool) -> str:
    name, email = ent.mention("name"), ent.mention("email")
    order, city = ent.mention("order"), ent.mention("city")
    distract = f"{ent.fresh('name')} from {ent.fresh('city')} had a similar problem with {ent.fresh('order')}"
    if first:
        text = (f"user: Hi, I am {name} from {city}, my email is {email}. My order {order} has a problem "
                f"with the {ent.mention('product')}. A friend, {distract}, but that one is solved.")
    else:
        text = (f"user: One more thing: please also check order {order} for {name} ({email}) in {city}. "
                f"Ignore the old ticket {ent.fresh('ticket')}.")
    return text + " " + _filler(rng, 0, 2)


def _tool_text(tool: str, args: dict, ent: _Entities, rng: np.random.Generator) -> str:
    if tool == "lookup_customer":
        body = (f"Customer {ent.mention('name')} based in {ent.mention('city')}. Orders on file: "
                f"{ent.mention('order')}, {ent.mention('order')}. Secondary contact {ent.mention('email')}.")
    elif tool == "search_orders":
        rows = [f"{ent.mention('order')} ({ent.mention('product')}, {ent.mention('amount')} USD)" for _ in range(3)]
        body = f"Found {len(rows)} orders for {args['customer']}: " + "; ".join(rows) + "."
    elif tool == "get_order":
        body = (f"Order {args['order_id']}: {ent.mention('product')}, total {ent.mention('amount')} USD, "
                f"status {rng.choice(STATUSES)}. Invoice stored at {ent.mention('file')}. "
                f"Related ticket {ent.mention('ticket')}.")
    elif tool == "read_file":
        body = (f"Contents of {args['path']}: item {ent.mention('product')} charged {ent.mention('amount')} USD, "
                f"shipping {ent.fresh('amount')} USD, billed to {ent.mention('email')}, order {ent.mention('order')}.")
    elif tool == "refund":
        body = f"Refund of {args['amount']} USD for {args['order_id']} issued, reference {ent.mention('ticket')}."
    elif tool == "send_email":
        body = f"Email to {args['to']} queued with subject '{args['subject']}'."
    else:
        body = f"Ticket {ent.mention('ticket')} created for {args['customer']} about the {args['summary']}."
    return "tool: " + body + " " + _filler(rng, 1, 3)


def generate_session(seed: int, index: int, n_calls: tuple[int, int] = (6, 12)) -> Session:
    """Session ``index`` of ``seed``: system, user, then tool call / result turns with occasional user follow-ups."""
    rng = np.random.default_rng([seed, index])
    ent = _Entities(rng)
    messages = [Message("system", SYSTEM), Message("user", _user_text(ent, rng, first=True))]
    for c in range(int(rng.integers(n_calls[0], n_calls[1] + 1))):
        if c > 0 and rng.random() < 0.15:
            messages.append(Message("user", _user_text(ent, rng, first=False)))
        tool = str(rng.choice(list(TOOLS)))
        args = {name: ent.pick(kind) for name, kind in TOOLS[tool]}
        if tool == "send_email":
            args["subject"] = f"{args['subject']} status"
        messages.append(Message("assistant", f"assistant: call {tool} {json.dumps(args)}", tool, args))
        messages.append(Message("tool", _tool_text(tool, args, ent, rng)))
    return Session(f"s{seed}-{index}", messages)


def generate_sessions(n: int, seed: int = 0) -> list[Session]:
    return [generate_session(seed, i) for i in range(n)]


# ----------------------------------------------------------------------------- tokens and labels

def wordpiece_tokenizer():
    """The project's offline MiniLM WordPiece ``tokenizers.Tokenizer`` (data.tokenizer)."""
    from data.tokenizer import TokenCounter

    return TokenCounter.wordpiece()._tokenizer


def _is_word(w: str) -> bool:
    return any(ch.isalnum() for ch in w)


def argument_values(value) -> list[str]:
    """The leaf values of a (JSON) argument value as they are written: strings as they are, numbers,
    booleans and null as JSON writes them; lists and objects flattened (an object's keys are names,
    not values, and are left out)."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in argument_values(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in argument_values(v)]
    return [value if isinstance(value, str) else json.dumps(value)]


def argument_words(args: dict, tokenizer) -> set[str]:
    """Normalised words of a call's argument values (punctuation-only words left out)."""
    words = set()
    for value in argument_values(args):
        norm = tokenizer.normalizer.normalize_str(value)
        words.update(w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str(norm) if _is_word(w))
    return words


@dataclass
class DecisionPoint:
    """The context just before tool call ``call``: positions ``[0, end)``; latest span ``[span_start, end)``."""

    call: int
    end: int
    span_start: int
    system_end: int
    labels: Tensor            # bool [end]: word appears in the arguments of calls call .. call+horizon-1

    @property
    def protected(self) -> Tensor:
        p = torch.zeros(self.end, dtype=torch.bool)
        p[: self.system_end] = True
        p[self.span_start:] = True
        return p


@dataclass
class TokenizedSession:
    session_id: str
    ids: Tensor                               # long [T]
    words: list[str]                          # normalised word of every token
    starts: list[int]                         # first token of every message
    decisions: list[DecisionPoint] = field(default_factory=list)


def tokenize_session(session: Session, tokenizer, horizon: int = 5) -> TokenizedSession:
    """Token ids, per-token words, and one :class:`DecisionPoint` per tool call (whose previous message
    is a user or tool message: the latest span)."""
    ids: list[int] = []
    words: list[str] = []
    starts: list[int] = []
    for msg in session.messages:
        starts.append(len(ids))
        enc = tokenizer.encode(msg.text + "\n", add_special_tokens=False)
        spans: dict[int, list[int]] = {}
        for wid, (a, b) in zip(enc.word_ids, enc.offsets):
            spans.setdefault(wid, [a, b])[1] = b
        for wid in enc.word_ids:
            a, b = spans[wid]
            words.append(tokenizer.normalizer.normalize_str(msg.text[a:b]) if wid is not None else "")
        ids.extend(enc.ids)
    out = TokenizedSession(session.session_id, torch.tensor(ids, dtype=torch.long), words, starts)
    calls = [i for i, m in enumerate(session.messages) if m.tool is not None]  # text replies are no calls
    arg_words = [argument_words(session.messages[i].args or {}, tokenizer) for i in calls]
    for c, m in enumerate(calls):
        if m < 2 or session.messages[m - 1].role not in ("user", "tool"):
            continue
        target = set().union(*arg_words[c: c + horizon])
        end = starts[m]
        labels = torch.tensor([_is_word(w) and w in target for w in words[:end]], dtype=torch.bool)
        out.decisions.append(DecisionPoint(call=c, end=end, span_start=starts[m - 1], system_end=starts[1],
                                           labels=labels))
    return out


# ----------------------------------------------------------------------------- features

FIXED_METHODS = ("intent_rule", "current_query", "streaming_llm", "h2o", "snapkv")


@dataclass
class Example:
    """One decision point: its labels, the untrained methods' scores and the keys the head reads."""

    session_id: str
    call: int
    span_start: int
    memory: Tensor            # M_t [L, H, D], after the latest span
    labels: Tensor            # bool [end]
    protected: Tensor         # bool [end]
    fixed: dict[str, Tensor]  # method -> scores [end], for FIXED_METHODS
    key_pieces: list[Tensor]  # float16 [L, H, n_i, D] slices, in order: the keys of [0, end)
    system_end: int = 0       # the system prefix is [0, system_end)
    output_tokens: int = 0    # tokens of the tool call's own message (the request's output)

    @property
    def rule(self) -> Tensor:
        return self.fixed["intent_rule"]

    @property
    def keys(self) -> Tensor:
        """``[L, H, end, D]`` float32 (assembled from the shared window slices on each access)."""
        return torch.cat(self.key_pieces, dim=2).float()


def fixed_scores(q: Tensor, k: Tensor, h2o: Tensor, span_start: int, memory: Tensor, snapkv_window: int,
                 sink: int) -> dict[str, Tensor]:
    """The scores of the methods that learn nothing, on one context's ``q, k [L, H, T, D]``:
    the intent rule (memory ``M_t``), its ablation with the current query alone (``Enc(q_t)``),
    StreamingLLM, H2O (the model's accumulated attention ``h2o [T]``) and SnapKV (observation
    window: the last ``snapkv_window`` queries of the latest span)."""
    from models.intentkv.pruning import encode_span, rule_scores, snapkv_scores, streaming_llm_scores

    window = max(span_start, k.shape[2] - snapkv_window)
    return {"intent_rule": rule_scores(memory, k),
            "current_query": rule_scores(encode_span(q[:, :, span_start:]), k),
            "streaming_llm": streaming_llm_scores(k.shape[2], sink),
            "h2o": h2o,
            "snapkv": snapkv_scores(q[:, :, window:], k)}


@torch.no_grad()
def build_examples(sessions: list[TokenizedSession], qk, lam: float = 0.5, snapkv_window: int = 32,
                   sink: int = 4) -> list[Example]:
    """Every decision point of ``sessions`` with its tensors from ``qk`` (a
    :class:`models.intentkv.minilm.WindowedQK`: each context run on its own, the system prefix's
    windows shared), carrying the intent memory across the session's decision points."""
    from models.intentkv.pruning import encode_span, update_memory

    examples = []
    for ts in sessions:
        qk.new_session()
        memory = None
        for dp in ts.decisions:
            parts = qk.pieces(ts.ids, dp.end, shared_until=dp.system_end)
            q = torch.cat([p[0] for p in parts], dim=2).float()
            k = torch.cat([p[1] for p in parts], dim=2).float()
            h2o = torch.cat([p[2] for p in parts]).float()
            memory = update_memory(memory, encode_span(q[:, :, dp.span_start:]), lam)
            m = ts.starts.index(dp.end)                        # the call's message
            output_end = ts.starts[m + 1] if m + 1 < len(ts.starts) else ts.ids.numel()
            examples.append(Example(ts.session_id, dp.call, dp.span_start, memory, dp.labels, dp.protected,
                                    fixed_scores(q, k, h2o, dp.span_start, memory, snapkv_window, sink),
                                    [p[1] for p in parts], dp.system_end, output_end - dp.end))
    return examples
