"""Training-state accounting (jaxsparse.memory) on a tiny BERT, checked against the trees themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxsparse import memory, pruning
from jaxsparse.models import bert


@pytest.fixture(scope="module")
def report():
    return memory.memory_report("tiny", ["dense", "64:2:8"])


def _nbytes(tree) -> int:
    """Bytes of an abstract tree (``jax.eval_shape``): an independent count of the same arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def test_dense_state_is_four_float32_copies_of_the_params(report):
    cfg = bert.BertConfig.preset("tiny")
    params = jax.eval_shape(bert.BertForSequenceClassification(cfg).init, jax.random.key(1), jnp.ones((1, 8), jnp.int32))["params"]
    dense = report["rows"][0]
    assert dense["mode"] == "dense"
    # weights + grads + mu + nu, plus AdamW's int32 step count
    assert dense["model"]["bytes"] == 4 * _nbytes(params) + 4
    assert dense["model"]["bytes_per_param"] == pytest.approx(16.0, abs=1e-3)
    assert dense["model"]["samo_bytes_per_param"] == 20.0


def test_compressed_64_2_8_sparse_layers_below_45_percent_of_dense(report):
    row = report["rows"][1]
    assert row["sparsity"] == "64:2:8" and row["mode"] == "compressed"
    frac = row["sparse_layers"]["fraction_of_dense"]
    # 2 of 8 values kept, plus metadata and columns: above the 25 % of the values alone, below the target
    assert 0.25 < frac < 0.45
    assert row["sparse_layers"]["pattern_bytes"] > 0
    whole = row["model"]["fraction_of_dense"]
    print(f"BERT-tiny 64:2:8 compressed: sparse layers {100 * frac:.1f} % of dense, whole model {100 * whole:.1f} %")
    assert frac < whole < 1.0  # the embeddings (dense) dominate a tiny BERT


def test_compressed_figures_are_the_leaves_of_the_compressed_trees(report):
    cfg = bert.BertConfig.preset("tiny")
    model = bert.BertForSequenceClassification(cfg, sparsity="64:2:8", compressed=True)
    variables = jax.eval_shape(model.init, jax.random.key(2), jnp.ones((1, 8), jnp.int32))
    row = report["rows"][1]
    assert row["model"]["pattern_bytes"] == _nbytes(variables[pruning.SPARSITY])
    assert row["model"]["weights_bytes"] == _nbytes(variables["params"])
    assert row["model"]["grads_bytes"] == _nbytes(variables["params"])  # float32 grads of float32 params
    qkv = row["types"]["attention.qkv"]
    values = [v for p, v in jax.tree_util.tree_flatten_with_path(variables["params"])[0]
              if memory.layer_type(pruning._path_names(p)) == "attention.qkv"]
    assert qkv["weights_bytes"] == sum(v.size * v.dtype.itemsize for v in values)


def test_layer_types():
    assert memory.layer_type(("bert", "encoder_layer_3", "attention", "key", "values")) == "attention.qkv"
    assert memory.layer_type(("0", "mu", "bert", "encoder_layer_0", "attention", "output", "kernel")) == "attention.output"
    assert memory.layer_type(("bert", "encoder_layer_0", "attention", "LayerNorm", "scale")) == "norms"
    assert memory.layer_type(("bert", "encoder_layer_0", "intermediate", "metadata")) == "ffn.intermediate"
    assert memory.layer_type(("bert", "encoder_layer_0", "output", "bias")) == "ffn.output"
    assert memory.layer_type(("bert", "embeddings_word_embeddings", "embedding")) == "embeddings"
    assert memory.layer_type(("classifier", "kernel")) == "head"
    assert memory.samo_bytes_per_param(0.0) == 20.0 and memory.samo_bytes_per_param(0.75) == pytest.approx(8.0)
