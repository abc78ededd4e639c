"""Self-contained predictor checkpoints.

A checkpoint is one ``torch.save`` file holding only plain values and tensors (it is read with
``torch.load(weights_only=True)``, so loading never runs pickled code)::

    format        "pbkv-predictor"
    version       1
    family        markov | graphsage | rgcn | intent_residual
    init          the constructor arguments: agent_names (the vocabulary, "<unk>" first),
                  horizon, max_path, text (the text source and encoder choice), graph (the call
                  graph: transition counts and typed relation edges), the Markov counts, the
                  family's hyper-parameters, time (models.timing.TimeSpec: quantile levels,
                  log offset, gap source, per-agent table) and for Markov its gaps
    state_dict    the weights (with the time head's, time_head.*)
    config        the resolved Hydra config of the run that trained it
    metrics       the run's validation and test metrics
    training      train seconds, epochs, parameter count

``load_predictor(path)`` rebuilds the predictor in eval mode, ready for ``predict()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from data.atomic import atomic_file
from models.base import UNK, Predictor
from models.graphsage import GraphSAGEPredictor, RGCNPredictor
from models.intent import IntentResidualPredictor
from models.markov import MarkovPredictor

FORMAT = "pbkv-predictor"
VERSION = 1
FAMILIES: dict[str, type[Predictor]] = {
    cls.family: cls for cls in (MarkovPredictor, GraphSAGEPredictor, RGCNPredictor, IntentResidualPredictor)
}


class CheckpointError(RuntimeError, ValueError):
    """The file is not a readable PBKV predictor checkpoint."""


class VocabularyMismatchError(ValueError):
    """The checkpoint's agent vocabulary does not cover the agents of the data."""


def save_predictor(predictor: Predictor, path: str | Path, config: dict | None = None,
                   metrics: dict | None = None, training: dict | None = None) -> Path:
    """Write the checkpoint atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "version": VERSION, "family": predictor.family,
        "init": _to_cpu(predictor.init_args()),
        "state_dict": {k: v.detach().cpu() for k, v in predictor.state_dict().items()},
        "config": config or {}, "metrics": metrics or {}, "training": training or {},
    }
    with atomic_file(path) as tmp:
        torch.save(payload, tmp)
    return path


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint's payload, checked for format and version."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no predictor checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path}: not a readable predictor checkpoint (corrupt or truncated?): "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a PBKV predictor checkpoint (no format={FORMAT!r} entry)")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {payload.get('version')}, this code reads {VERSION}")
    if payload.get("family") not in FAMILIES:
        raise CheckpointError(f"{path}: unknown predictor family {payload.get('family')!r}; "
                              f"known: {sorted(FAMILIES)}")
    return payload


def with_old_defaults(family: str, init: dict) -> dict:
    """Constructor arguments of a checkpoint written before a knob existed, with the value those
    runs had: graph predictors without `identity` embedded agents by vocabulary id only."""
    if family in ("graphsage", "rgcn") and "identity" not in init:
        return {**init, "identity": False}
    return init


def load_predictor(path: str | Path, agents: Iterable[str] | None = None, device: str = "cpu",
                   max_unknown: float = 0.0) -> Predictor:
    """Rebuild a predictor in eval mode; with ``agents`` (those of the data it will see), check
    that its vocabulary covers them (see check_vocabulary)."""
    payload = read_checkpoint(path)
    try:
        predictor = FAMILIES[payload["family"]](**with_old_defaults(payload["family"], payload["init"]))
        predictor.load_state_dict(payload["state_dict"])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path}: checkpoint of family {payload['family']!r} does not rebuild: {e}") from e
    if agents is not None:
        check_vocabulary(predictor, agents, source=str(path), max_unknown=max_unknown)
    return predictor.to(device).eval()


def check_vocabulary(predictor: Predictor, agents: Iterable[str], source: str = "the checkpoint",
                     max_unknown: float = 0.0) -> None:
    """Raise VocabularyMismatchError when more than ``max_unknown`` of the data's distinct agents
    are missing from the predictor's vocabulary (they would all collapse onto <unk>)."""
    data_agents = sorted(set(agents) - {UNK})
    known = set(predictor.agent_names)
    missing = [a for a in data_agents if a not in known]
    if data_agents and len(missing) > max_unknown * len(data_agents):
        raise VocabularyMismatchError(
            f"{source} was trained on agents {predictor.agent_names[1:]}, but the data calls "
            f"{len(missing)} of its {len(data_agents)} agents that it does not know: {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}. Train a predictor on this workload (python train.py "
            f"data=... ), or pass max_unknown to map them to <unk>.")


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_cpu(v) for v in value]
    return value
