"""PBKV predictors (docs/predictors.md): one interface, four families.

    from models import WorkflowPrefix, load_predictor, survival
    predictor = load_predictor("runs/.../predictor.pt")
    probs = predictor.predict([WorkflowPrefix(["retriever", "summarizer"], task="Verify ...")])
    probs.shape == (1, predictor.horizon, len(predictor.agent_names) + 1)   # last class: END
    alive = survival(probs)                                                 # [1, K]
"""

from models.base import UNK, PrefixBatch, Predictor, WorkflowPrefix, survival
from models.checkpoint import (FAMILIES, CheckpointError, VocabularyMismatchError, check_vocabulary,
                               load_predictor, read_checkpoint, save_predictor)

__all__ = ["UNK", "FAMILIES", "CheckpointError", "PrefixBatch", "Predictor", "VocabularyMismatchError",
           "WorkflowPrefix", "check_vocabulary", "load_predictor", "read_checkpoint", "save_predictor", "survival"]
