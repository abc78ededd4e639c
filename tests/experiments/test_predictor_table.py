"""benchmarks/predictor_table.py: rows by family or by family and text signal, spread or interval."""

import json

import pytest
from scipy import stats

from benchmarks.predictor_table import format_table
from models import save_predictor
from models.graph import CallGraph
from models.graphsage import GraphSAGEPredictor
from models.markov import MarkovPredictor
from models.text import TextSpec

AGENTS = ["<unk>", "a", "b"]


def run(tmp_path, name, predictor, top1):
    folder = tmp_path / name
    checkpoint = save_predictor(predictor, folder / "predictor.pt")
    metrics = {"checkpoint": str(checkpoint), **{f"test/top1_k{k}": v for k, v in enumerate(top1, start=1)}}
    (folder / "metrics.json").write_text(json.dumps(metrics))


def graphsage(source):
    text = TextSpec("hidden", 4) if source == "hidden" else TextSpec()
    return GraphSAGEPredictor(AGENTS, 2, graph=CallGraph.from_sequences([[1, 2]], 3).to_dict(), text=text.to_dict(),
                              identity=False, dim=4, hidden=8)


def test_rows_by_text_signal_with_student_t_intervals(tmp_path):
    for i, value in enumerate([0.8, 0.9, 0.7]):
        run(tmp_path, f"h{i}", graphsage("hidden"), [value, value - 0.1])
        run(tmp_path, f"n{i}", graphsage("none"), [0.5, 0.4])
    run(tmp_path, "m0", MarkovPredictor.from_sequences(AGENTS, 2, [[1, 2]]), [0.6, 0.5])
    by_family = format_table([tmp_path], ["top1"])
    assert "| graphsage | 6 |" in by_family and "| markov | 1 | 0.600 | 0.500 |" in by_family
    table = format_table([tmp_path], ["top1"], by_text=True, interval=True)
    half = stats.t.ppf(0.975, 2) * 0.1 / 3 ** 0.5  # stdev of 0.8, 0.9, 0.7 is 0.1
    assert f"| graphsage [hidden] | 3 | 0.800 [{0.8 - half:.3f}, {0.8 + half:.3f}] |" in table
    assert "| graphsage [none] | 3 | 0.500 [0.500, 0.500] |" in table and "| markov [none] | 1 |" in table
    lines = table.splitlines()
    assert [line.split(" |")[0] for line in lines[2:]] == ["| markov [none]", "| graphsage [hidden]",
                                                          "| graphsage [none]"]
    assert pytest.approx(half, abs=1e-3) == 0.248
