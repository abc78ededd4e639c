"""The predictor interface contract, the Markov propagation, the intent residual's start, the
checkpoint format and its errors, the text cache, examples and metrics (CPU, seconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from data import store
from data.generators import Hover
from models import (CheckpointError, VocabularyMismatchError, WorkflowPrefix, load_predictor, read_checkpoint,
                    save_predictor, survival)
from models.base import IGNORE_INDEX, UNK
from models.datamodule import TraceDataModule
from models.graphsage import GraphSAGEPredictor, RGCNPredictor
from models.intent import IntentResidualPredictor
from models.markov import BOS, MarkovPredictor
from models.metrics import horizon_metrics
from models.module import PredictorModule
from models.text import HashingTextEncoder, TextFeatures, TextSpec, projection_matrix

K = 3


@pytest.fixture(scope="module")
def datamodule() -> TraceDataModule:
    ds = store.build(Hover().generate(40, seed=0), val=0.2, test=0.2, seed=0)
    dm = TraceDataModule(dataset=ds, horizon=K, seed=0, max_path=8, batch_size=64, text_encoder=HashingTextEncoder(dim=64))
    dm.setup()
    return dm


def build(family: str, corpus, seed: int = 0):
    torch.manual_seed(seed)
    if family == "markov":
        return MarkovPredictor.from_corpus(corpus, order=2).eval()
    if family == "intent_residual":
        return IntentResidualPredictor.from_corpus(corpus, dim=16, hidden=32).eval()
    cls = GraphSAGEPredictor if family == "graphsage" else RGCNPredictor
    return cls.from_corpus(corpus, dim=16, hidden=32, identity=False).eval()


FAMILIES = ["markov", "graphsage", "rgcn", "intent_residual"]
CLAIM = "Verify the claim against Wikipedia. Claim: The director of Copper Sky was born in Porto."


def prefixes() -> list[WorkflowPrefix]:
    return [WorkflowPrefix(["retriever"], CLAIM),
            WorkflowPrefix(["retriever", "summarizer", "query_generator", "retriever", "summarizer"], "other"),
            WorkflowPrefix(["retriever", "summarizer", "verifier"] * 5, CLAIM)]  # longer than max_path


def attach_encoder(predictor, dm):
    predictor.text_features.attach(dm.text_encoder if predictor.text_spec.source == "encoder" else None)
    return predictor


# ------------------------------------------------------------------ interface contract
@pytest.mark.parametrize("family", FAMILIES)
def test_predict_shapes_and_probabilities(family, datamodule):
    predictor = attach_encoder(build(family, datamodule.corpus), datamodule)
    assert predictor.agent_names[0] == UNK and predictor.horizon == K
    probs = predictor.predict(prefixes())
    assert probs.shape == (3, K, len(predictor.agent_names) + 1)
    assert not probs.requires_grad
    assert torch.all(probs >= 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, K))


@pytest.mark.parametrize("family", FAMILIES)
def test_unknown_agents_map_to_unk(family, datamodule):
    predictor = attach_encoder(build(family, datamodule.corpus), datamodule)
    unknown = predictor.predict([WorkflowPrefix(["retriever", "never_seen_agent"], CLAIM)])
    explicit = predictor.predict([WorkflowPrefix(["retriever", UNK], CLAIM)])
    torch.testing.assert_close(unknown, explicit)
    assert predictor.agent_id("never_seen_agent") == 0


def test_predict_rejects_empty_prefixes(datamodule):
    predictor = build("markov", datamodule.corpus)
    with pytest.raises(ValueError, match="at least one"):
        predictor.predict([])
    with pytest.raises(ValueError, match="at least one agent"):
        predictor.predict([WorkflowPrefix([], CLAIM)])


def test_predict_leaves_training_mode_alone(datamodule):
    predictor = attach_encoder(build("graphsage", datamodule.corpus), datamodule).train()
    first = predictor.predict(prefixes())
    assert predictor.training
    torch.testing.assert_close(first, predictor.predict(prefixes()))  # dropout off inside predict


def test_survival_is_the_product_of_end_complements():
    probs = torch.tensor([[[0.7, 0.1, 0.2], [0.4, 0.1, 0.5], [0.0, 0.0, 1.0]]])
    torch.testing.assert_close(survival(probs), torch.tensor([[1.0, 0.8, 0.4]]))


# ------------------------------------------------------------------ markov
def test_markov_k_step_on_a_hand_made_chain():
    # a -> b (3 times) or a -> c (once); b and c end the workflow. Nearly unsmoothed.
    names = [UNK, "a", "b", "c"]
    seqs = [[1, 2]] * 3 + [[1, 3]]
    markov = MarkovPredictor.from_sequences(names, 3, seqs, order=1, alpha=1e-9, backoff=1e-9)
    p = markov.predict([WorkflowPrefix(["a"])])[0]
    torch.testing.assert_close(p[0], torch.tensor([0, 0, 0.75, 0.25, 0]), atol=1e-6, rtol=0)
    end = torch.tensor([0, 0, 0, 0, 1.0])
    torch.testing.assert_close(p[1], end, atol=1e-6, rtol=0)  # b or c, then END for sure
    torch.testing.assert_close(survival(p[None])[0], torch.tensor([1.0, 1.0, 0.0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("order", [1, 2, 3])
def test_markov_propagation_matches_path_enumeration(order):
    """P^(k) from the precomputed table equals brute-force enumeration of all k-step futures
    under the model's own one-step backoff probabilities (so the state automaton is exact)."""
    names = [UNK, "a", "b", "c"]
    seqs = [[1, 2, 1, 3], [1, 2, 2, 1], [2, 3], [1, 1, 2, 3, 1]]
    markov = MarkovPredictor.from_sequences(names, 3, seqs, order=order, alpha=0.5, backoff=0.7)
    emit = markov.smoothed_probs()
    end = markov.end_index

    def one_step(history):
        return emit[markov.longest_seen_suffix(tuple(([BOS] * order + history)[-order:]))]

    for history in ([1], [1, 2], [2, 3, 1], [3, 3], [0, 1]):
        got = markov.predict([WorkflowPrefix([names[i] for i in history])])[0].double()
        alive, expected = [(1.0, list(history))], []
        for _ in range(3):  # all futures that are still running at step k, with their probability
            mix = sum(prob * one_step(seq) for prob, seq in alive)
            expected.append(mix / sum(prob for prob, _ in alive))
            alive = [(prob * one_step(seq)[a].item(), seq + [a]) for prob, seq in alive for a in range(end)]
        torch.testing.assert_close(got, torch.stack(expected), atol=1e-6, rtol=1e-5)


def test_markov_unseen_context_backs_off_to_its_suffix():
    names = [UNK, "a", "b"]
    markov = MarkovPredictor.from_sequences(names, 2, [[1, 2, 1, 2]], order=2, alpha=0.1, backoff=1.0)
    assert (2, 2) not in markov.contexts  # (b, b) was never seen: predict exactly as after (b)
    after_b = markov.smoothed_probs()[markov.contexts.index((2,))].float()
    torch.testing.assert_close(markov.predict([WorkflowPrefix(["a", "b", "b"])])[0, 0], after_b)
    counts = markov.context_counts[markov.contexts.index((1, 2))]
    assert counts.tolist() == [0, 1, 0, 1]  # (a, b) was followed by a once and by END once


# ------------------------------------------------------------------ intent residual
def test_intent_residual_equals_markov_prior_at_init(datamodule):
    intent = attach_encoder(build("intent_residual", datamodule.corpus), datamodule)
    prior = MarkovPredictor.from_corpus(datamodule.corpus, order=2)
    torch.testing.assert_close(intent.predict(prefixes()), prior.predict(prefixes()), atol=1e-6, rtol=1e-5)


def test_intent_memory_is_unit_norm_and_decays(datamodule):
    intent = attach_encoder(build("intent_residual", datamodule.corpus), datamodule)
    batch = intent.encode_prefixes(prefixes())
    memory = intent.intent_memory(batch, intent.text_vector(batch))
    torch.testing.assert_close(memory.norm(dim=-1), torch.ones(3))
    assert intent.hparams["decay"] == 0.5


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_round_trip(family, datamodule, tmp_path):
    predictor = attach_encoder(build(family, datamodule.corpus), datamodule)
    with torch.no_grad():  # make the weights differ from a fresh init
        for p in predictor.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = save_predictor(predictor, tmp_path / "p.pt", config={"model": {"name": family}},
                          metrics={"test/top1_k1": 0.5})
    loaded = load_predictor(path)
    assert type(loaded) is type(predictor) and not loaded.training
    assert loaded.agent_names == predictor.agent_names and loaded.text_spec == predictor.text_spec
    torch.testing.assert_close(loaded.predict(prefixes()), predictor.predict(prefixes()))
    payload = read_checkpoint(path)
    assert payload["metrics"] == {"test/top1_k1": 0.5} and payload["config"]["model"]["name"] == family


def test_corrupted_checkpoint_gives_a_clear_error(datamodule, tmp_path):
    path = save_predictor(build("graphsage", datamodule.corpus), tmp_path / "p.pt")
    data = path.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all" * 10)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    for name in ("truncated.pt", "garbage.pt"):
        with pytest.raises(CheckpointError, match="corrupt or truncated"):
            load_predictor(tmp_path / name)
    with pytest.raises(CheckpointError, match="not a PBKV predictor checkpoint"):
        load_predictor(tmp_path / "foreign.pt")
    with pytest.raises(FileNotFoundError):
        load_predictor(tmp_path / "missing.pt")


def test_checkpoint_with_wrong_weights_gives_a_clear_error(datamodule, tmp_path):
    path = save_predictor(build("graphsage", datamodule.corpus), tmp_path / "p.pt")
    payload = torch.load(path, weights_only=True)
    payload["state_dict"]["head.lins.0.weight"] = torch.zeros(3, 3)
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="does not rebuild"):
        load_predictor(tmp_path / "bad.pt")


def test_vocabulary_mismatch_gives_a_clear_error(datamodule, tmp_path):
    path = save_predictor(build("markov", datamodule.corpus), tmp_path / "p.pt")
    assert load_predictor(path, agents=["retriever", "verifier"]).agent_names[0] == UNK
    with pytest.raises(VocabularyMismatchError, match=r"does not know: \['coder', 'planner'\]"):
        load_predictor(path, agents=["planner", "coder", "retriever"])
    load_predictor(path, agents=["planner", "retriever", "verifier"], max_unknown=0.5)  # tolerated


# ------------------------------------------------------------------ text features
class CountingEncoder(HashingTextEncoder):
    def __init__(self):
        super().__init__(dim=32)
        self.encoded: list[str] = []

    def encode(self, texts):
        self.encoded.extend(texts)
        return super().encode(texts)


def test_text_cache_encodes_each_task_once_and_evicts_lru():
    encoder = CountingEncoder()
    features = TextFeatures(TextSpec("encoder", 32, encoder.spec()), cache_size=2)
    features.attach(encoder)
    first = features.encode_tasks(["x", "y", "x"])
    assert encoder.encoded == ["x", "y"]
    torch.testing.assert_close(first[0], first[2])
    features.encode_tasks(["x"])  # a hit: x becomes the most recent
    features.encode_tasks(["z"])  # evicts y
    features.encode_tasks(["x", "z"])
    assert encoder.encoded == ["x", "y", "z"]
    features.encode_tasks(["y"])
    assert encoder.encoded[-1] == "y" and len(features) == 2
    torch.testing.assert_close(features.encode_tasks(["y", "z"]), encoder.encode(["y", "z"]))


def test_minilm_shares_one_model_and_answers_a_text_it_encoded_from_memory(monkeypatch):
    import models.text as text

    monkeypatch.setattr(text, "_MINILM_TEXTS", text.OrderedDict())
    monkeypatch.setattr(text, "MINILM_MEMO", 2)
    encoded_now, real_encode = [], text.MiniLMTextEncoder._encode
    monkeypatch.setattr(text.MiniLMTextEncoder, "_encode",
                        lambda self, t: encoded_now.extend(t) or real_encode(self, t))
    first, second = text.MiniLMTextEncoder(), text.MiniLMTextEncoder()
    texts = ["find the 2019 revenue", "a much longer task about the verifier agent and its sources"]
    encoded = first.encode(texts)
    assert second._load() is first._load()  # one model per process and device
    again = second.encode(texts[::-1])  # another list of the same texts: from memory
    assert torch.equal(again, encoded.flip(0)) and encoded_now == texts
    again += 1  # the caller's copy: the memory keeps the encoder's answer
    assert torch.equal(first.encode(texts), encoded)
    first.encode(["a", "b"])  # two other texts push them out (MINILM_MEMO = 2)
    assert not {key[1] for key in text._MINILM_TEXTS} & set(texts)
    assert torch.equal(first.encode(texts), encoded)  # encoded again: bit for bit the same
    assert encoded_now == [*texts, "a", "b", *texts]


def test_a_minilm_embedding_is_the_one_its_text_gets_alone_in_any_list_and_on_any_thread_count(monkeypatch):
    """MiniLMTextEncoder._encode batches only texts of one token length, on one thread: a text's
    floats are those of encoding it alone, whatever list it comes in, so an embedding kept by text
    is exact."""
    import models.text as text

    monkeypatch.setattr(text, "_MINILM_TEXTS", text.OrderedDict())
    encoder = text.MiniLMTextEncoder(batch_size=2)
    # two pairs of one token length each (a batch of 2 and one of 1 per length), and longer texts
    texts = ["find the revenue", "check the claim", "verify the sources", "rank the passages",
             "a much longer task about the verifier agent and its sources", "x"]
    model = encoder._load()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.cat([model.encode([t], batch_size=1, convert_to_tensor=True, normalize_embeddings=True,
                                        show_progress_bar=False).float().cpu() for t in texts])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(encoder.encode(texts), alone)
    text._MINILM_TEXTS.clear()
    torch.set_num_threads(2)
    try:
        assert torch.equal(encoder.encode(texts[::-1]), alone.flip(0))
        assert torch.get_num_threads() == 2  # the caller's threads, put back
    finally:
        torch.set_num_threads(threads)
    text._MINILM_TEXTS.clear()


def test_minilm_embeddings_kept_on_disk_are_read_back_by_text_and_a_broken_file_is_encoded_again(monkeypatch,
                                                                                                 tmp_path):
    import models.text as text

    monkeypatch.setattr(text, "_MINILM_TEXTS", text.OrderedDict())
    monkeypatch.setattr(text, "MINILM_DISK_MIN_TEXTS", 2)
    monkeypatch.setattr(text, "_minilm_disk", [])
    monkeypatch.setattr(text, "_shelves", {})
    texts = ["find the 2019 revenue", "check the claim against two sources"]
    text.keep_encodings_in(tmp_path / "kept")
    text.MiniLMTextEncoder().encode(texts[:1])  # shorter than MINILM_DISK_MIN_TEXTS: memory only
    assert not (tmp_path / "kept").exists()
    text._MINILM_TEXTS.clear()
    encoded = text.MiniLMTextEncoder().encode(texts)
    (kept,) = (tmp_path / "kept").glob("minilm-*.npz")

    def new_process():
        text._MINILM_TEXTS.clear()
        text._shelves.clear()

    new_process()
    encoded_now = []
    real_encode = text.MiniLMTextEncoder._encode
    monkeypatch.setattr(text.MiniLMTextEncoder, "_encode",
                        lambda self, t: encoded_now.extend(t) or real_encode(self, t))
    third = "a third task, not kept yet"
    both = text.MiniLMTextEncoder().encode([texts[1], third, texts[0]])  # by text: another list reads them
    assert encoded_now == [third]
    assert torch.equal(both[[2, 0]], encoded)
    assert len(list((tmp_path / "kept").glob("minilm-*.npz"))) == 2  # the third is kept in a file of its own
    new_process()
    kept.write_bytes(b"not an array")
    encoded_now.clear()
    assert torch.equal(text.MiniLMTextEncoder().encode(texts), encoded)  # encoded again, bit for bit
    assert encoded_now == texts
    new_process()
    encoded_now.clear()
    assert torch.equal(text.MiniLMTextEncoder().encode(texts), encoded)  # and kept again (the same file)
    assert encoded_now == []
    new_process()


def test_hidden_vectors_are_used_when_the_trace_has_them():
    features = TextFeatures(TextSpec("hidden", 3))
    rows = features([WorkflowPrefix(["a"], hidden=[1.0, 2.0, 3.0]), WorkflowPrefix(["a"])])
    torch.testing.assert_close(rows, torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="2 dims"):
        features([WorkflowPrefix(["a"], hidden=[1.0, 2.0])])


# ------------------------------------------------------------------ examples and metrics
def test_examples_label_the_next_k_calls_then_end_then_mask(datamodule):
    corpus = datamodule.corpus
    path, n_calls, text, labels, _ = datamodule.splits["train"][:]  # and the times: test_timing.py
    first = corpus.train_sequences[0]
    end = len(corpus.agent_names)
    expected = (first + [end] + [IGNORE_INDEX] * K)
    for t in range(len(first)):
        assert labels[t].tolist() == expected[t + 1:t + 1 + K]
        assert n_calls[t] == t + 1 and path[t, -1] == first[t]
    assert text.shape == (len(labels), 64)


def test_a_batch_is_gathered_at_once_and_is_what_one_example_at_a_time_gives(datamodule):
    """The loaders read a batch with one gather per tensor (Examples.__getitems__): the same
    shuffled batches, the same tensors, as a TensorDataset read one example at a time and stacked
    by default_collate, from the same seeded generator, epoch after epoch (so training is unchanged)."""
    from torch.utils.data import DataLoader, TensorDataset

    split = datamodule.splits["train"]
    assert len(split) > 2 * datamodule.batch_size  # full batches and a shorter last one
    ours = datamodule.train_dataloader()
    theirs = DataLoader(TensorDataset(*split.tensors), batch_size=datamodule.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(datamodule.seed))
    for _ in range(2):  # the generator moves on between epochs in both
        for mine, reference in zip(ours, theirs, strict=True):
            assert isinstance(mine, list) and len(mine) == len(reference) == len(split.tensors)
            for a, b in zip(mine, reference):  # bit for bit, NaN where a time is masked
                assert a.is_contiguous()
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    first = next(iter(datamodule.train_dataloader()))[0]
    assert not torch.equal(first, split.tensors[0][:len(first)])  # shuffled, not the split's first rows


def test_graph_has_agents_and_end_as_nodes(datamodule):
    graph = datamodule.corpus.graph
    end = len(datamodule.corpus.agent_names)
    assert graph.n_nodes == end + 1
    assert graph.transitions[:, end].sum() == len(datamodule.corpus.train_sequences)  # one END per workflow
    weights = graph.successor_weights()
    torch.testing.assert_close(weights[1:end].sum(1), torch.ones(end - 1))


def test_horizon_metrics_on_a_known_case():
    probs = np.array([[[0.1, 0.7, 0.2], [0.2, 0.2, 0.6]],
                      [[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]]])
    labels = np.array([[1, 2], [1, IGNORE_INDEX]])
    m = horizon_metrics(probs, labels, "test")
    assert m["test/top1_k1"] == m["test/top1_alive_k1"] == 0.5
    # the second workflow has ended before step 2: unconditionally its step 2 is END, and the
    # unconditional distribution (0.54, 0.27, 0.19) guesses agent 0: wrong; conditional on alive it is not counted
    assert m["test/top1_alive_k2"] == 1.0 and m["test/top1_k2"] == 0.5
    assert math.isclose(m["test/nll_k1"], -(math.log(0.7) + math.log(0.3)) / 2)
    assert m["test/end_acc_k1"] == 1.0 and m["test/end_acc_k2"] == 1.0
    assert math.isclose(m["test/ece_k2"], 0.4, abs_tol=1e-6)  # one prediction at confidence 0.6, correct


def test_module_loss_ignores_masked_steps(datamodule):
    module = PredictorModule(build("graphsage", datamodule.corpus))
    batch = datamodule.splits["train"][:8]
    loss, logits, labels = module.loss(batch)
    assert torch.isfinite(loss) and logits.shape == (8, K, len(datamodule.corpus.agent_names) + 1)


def test_factorised_path_attention_equals_scaled_dot_product_attention(datamodule):
    predictor = build("graphsage", datamodule.corpus)
    batch = predictor.encode_prefixes(prefixes())
    with torch.no_grad():
        tables = predictor.lookup_tables()
        positions = batch.positions.clamp(max=predictor.position.num_embeddings - 1)
        tokens = tables["nodes"][batch.path] + predictor.position(positions)
        expected = torch.nn.functional.scaled_dot_product_attention(
            predictor.query(tokens[:, -1:]), predictor.key(tokens), predictor.value(tokens),
            attn_mask=batch.mask[:, None, :]).squeeze(1)
        torch.testing.assert_close(predictor.path_attention(tables, batch), expected, atol=1e-5, rtol=1e-4)


def test_serving_tables_follow_weight_changes(datamodule):
    predictor = attach_encoder(build("graphsage", datamodule.corpus), datamodule)
    before = predictor.predict(prefixes())
    with torch.no_grad():
        predictor.node_embedding.weight.mul_(3.0)
    after = predictor.predict(prefixes())
    assert not torch.allclose(before, after)
    fresh = type(predictor)(**predictor.init_args())
    fresh.load_state_dict(predictor.state_dict())
    torch.testing.assert_close(attach_encoder(fresh.eval(), datamodule).predict(prefixes()), after)


def test_hidden_vectors_in_the_trace_become_the_text_signal():
    traces = Hover().generate(20, seed=3)
    for i, call in enumerate(traces.calls):
        call["hidden"] = [float(i % 5), 1.0, 0.0, -1.0]
    dm = TraceDataModule(dataset=store.build(traces, val=0.2, test=0.2), horizon=K, seed=0, max_path=8,
                         text_encoder=HashingTextEncoder(dim=64))
    dm.setup()
    assert dm.corpus.text.source == "hidden" and dm.corpus.text.dim == 4
    text = dm.splits["train"][:][2]
    assert torch.equal(text[:, 1:], torch.tensor([1.0, 0.0, -1.0]).expand(len(text), 3))
    predictor = GraphSAGEPredictor.from_corpus(dm.corpus, dim=16, hidden=32, identity=False).eval()
    probs = predictor.predict([WorkflowPrefix(["retriever"], "any", [1.0, 2.0, 3.0, 4.0]),
                               WorkflowPrefix(["retriever"])])  # no hidden: zeros
    assert probs.shape == (2, K, len(predictor.agent_names) + 1)


def test_a_fixed_random_projection_brings_hidden_states_to_the_input_size(tmp_path):
    """hidden_dim: training examples and serving prefixes go through the same seeded projection,
    which the checkpoint stores; raw and already-projected vectors give the same prediction."""
    traces = Hover().generate(20, seed=3)
    for i, call in enumerate(traces.calls):
        call["hidden"] = [float((i * j) % 7) - 3.0 for j in range(12)]
    dataset = store.build(traces, val=0.2, test=0.2)
    dm = TraceDataModule(dataset=dataset, horizon=K, seed=4, max_path=8, hidden_dim=5)
    dm.setup()
    spec = dm.corpus.text
    assert (spec.source, spec.dim, spec.hidden_size, spec.projection_seed) == ("hidden", 5, 12, 4)
    raw = torch.tensor([c["hidden"] for c in dataset.rows("train")])
    torch.testing.assert_close(dm.splits["train"][:][2], raw @ projection_matrix(12, 5, 4))
    again = TraceDataModule(dataset=dataset, horizon=K, seed=4, max_path=8, hidden_dim=5)
    again.setup()
    assert torch.equal(again.splits["test"][:][2], dm.splits["test"][:][2])  # seeded: the same matrix
    predictor = GraphSAGEPredictor.from_corpus(dm.corpus, dim=16, hidden=32, identity=False).eval()
    loaded = load_predictor(save_predictor(predictor, tmp_path / "p.pt"))
    assert torch.equal(loaded.hidden_projection, projection_matrix(12, 5, 4))  # in the checkpoint
    vector = raw[0].tolist()
    projected = loaded.project_hidden(raw[:1])[0].tolist()
    torch.testing.assert_close(loaded.predict([WorkflowPrefix(["retriever"], "", vector)]),
                               loaded.predict([WorkflowPrefix(["retriever"], "", projected)]))
    with pytest.raises(ValueError, match="takes 5 \\(or 12, projected\\)"):
        loaded.predict([WorkflowPrefix(["retriever"], "", [1.0, 2.0])])
    with pytest.raises(ValueError, match="calls without one"):
        TraceDataModule(dataset=store.build(Hover().generate(20, seed=3)), horizon=K, seed=0,
                        text_source="hidden").setup()


# ------------------------------------------------------------------ agent identity (name + system prompt)
def identity_predictor(family: str, corpus, encoder):
    torch.manual_seed(0)
    cls = GraphSAGEPredictor if family == "graphsage" else RGCNPredictor
    predictor = cls.from_corpus(corpus, dim=16, hidden=32, identity=True).eval()
    predictor.text_features.attach(encoder)
    predictor.identity_features.attach(encoder)
    return predictor


@pytest.mark.parametrize("family", ["graphsage", "rgcn"])
def test_an_unseen_agent_is_its_identity_not_unk(family, datamodule):
    predictor = identity_predictor(family, datamodule.corpus, datamodule.text_encoder)
    batch = predictor.encode_prefixes([WorkflowPrefix(["retriever", "Fact_Checker"], CLAIM)])
    assert batch.path[0, -1] == predictor.n_classes  # past the vocabulary, not <unk>
    torch.testing.assert_close(batch.unseen[0], datamodule.text_encoder.encode(["Fact Checker"])[0])
    unseen = predictor.predict([WorkflowPrefix(["retriever", "Fact_Checker"], CLAIM)])
    unk = predictor.predict([WorkflowPrefix(["retriever", UNK], CLAIM)])
    other = predictor.predict([WorkflowPrefix(["retriever", "planner"], CLAIM)])
    assert not torch.allclose(unseen, unk, atol=1e-5) and not torch.allclose(unseen, other, atol=1e-5)
    # the same agent met again keeps its id; a described system prompt gives a new agent a different input
    assert predictor.encode_prefixes([WorkflowPrefix(["Fact_Checker"], CLAIM)]).path[0, -1] == predictor.n_classes
    predictor.describe_agents({"critic": "You check every claim against the retrieved passages."})
    described = predictor.encode_prefixes([WorkflowPrefix(["critic"], CLAIM)])
    assert not torch.allclose(described.unseen[-1], datamodule.text_encoder.encode(["critic"])[0])


def test_identity_training_reaches_the_projection_and_known_agents_carry_their_text(datamodule):
    predictor = identity_predictor("graphsage", datamodule.corpus, datamodule.text_encoder).train()
    assert predictor.agent_texts[0] == "" and "query generator" in predictor.agent_texts
    assert predictor.identity_vectors[0].abs().sum() == 0 and predictor.identity_vectors[1].abs().sum() > 0
    loss, _, _ = PredictorModule(predictor).loss(datamodule.splits["train"][:64])
    loss.backward()
    assert torch.isfinite(loss) and predictor.identity_proj.weight.grad.abs().sum() > 0


def test_val_and_test_agents_outside_the_vocabulary_keep_an_identity_in_the_examples():
    ds = store.build(Hover().generate(40, seed=0), val=0.2, test=0.2, seed=0)
    ds.calls["test"] = ds.calls["test"].map(lambda r: {"agent": "fact_checker" if r["agent"] == "verifier" else r["agent"]})
    dm = TraceDataModule(dataset=ds, horizon=K, seed=0, max_path=8, text_encoder=HashingTextEncoder(dim=64))
    dm.setup()
    corpus = dm.corpus
    assert corpus.unseen_agents == ["fact_checker"] and "fact_checker" not in corpus.agent_names
    n_classes = len(corpus.agent_names) + 1
    path, n_calls, text, labels, _ = dm.splits["test"][:]
    assert (path == n_classes).any() and not (labels >= n_classes).any()  # paths name it; labels say <unk>
    graph = identity_predictor("graphsage", corpus, dm.text_encoder)
    markov = MarkovPredictor.from_corpus(corpus, order=2)
    assert graph.example_batch(path, n_calls, text).path.max() == n_classes
    assert markov.example_batch(path, n_calls, text).path.max() < n_classes  # no identities: <unk>
    # serving meets the same agent under the same id as the examples
    assert graph.encode_prefixes([WorkflowPrefix(["fact_checker"], CLAIM)]).path[0, -1] == n_classes


def test_checkpoint_keeps_agent_texts_and_old_ones_load_or_say_why(datamodule, tmp_path):
    predictor = identity_predictor("graphsage", datamodule.corpus, datamodule.text_encoder)
    with torch.no_grad():
        predictor.identity_proj.weight.add_(0.1)
    path = save_predictor(predictor, tmp_path / "p.pt")
    loaded = load_predictor(path)
    assert loaded.agent_texts == predictor.agent_texts and loaded.identity_encoder == predictor.identity_encoder
    torch.testing.assert_close(loaded.identity_vectors, predictor.identity_vectors)
    new_agent = [WorkflowPrefix(["retriever", "Fact_Checker"], CLAIM)]
    torch.testing.assert_close(loaded.predict(new_agent), predictor.predict(new_agent))
    # a checkpoint from before identities (no identity entry) loads, its unseen agents as <unk>
    old = save_predictor(build("graphsage", datamodule.corpus), tmp_path / "old.pt")
    assert load_predictor(old).identity_proj is None
    # one that asks for identities but lost its texts says so
    payload = torch.load(path, weights_only=True)
    del payload["init"]["agent_texts"]
    torch.save(payload, tmp_path / "no_texts.pt")
    with pytest.raises(CheckpointError, match="lacks the agents' identity texts"):
        load_predictor(tmp_path / "no_texts.pt")
