"""Flax BERT: structure, NMDense placement, Hugging Face name mapping, and the pretrained MiniLM."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from jaxsparse import data, format as fmt, pruning
from jaxsparse.models import bert

TINY = bert.BertConfig.preset("tiny", vocab_size=100, max_position_embeddings=32)
LINEARS = {("attention", "query"), ("attention", "key"), ("attention", "value"), ("attention", "output"),
           ("intermediate",), ("output",)}


def _ids(b=2, t=8, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 1, TINY.vocab_size)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_classifier_shapes_dtypes_and_sparse_layers(dtype):
    model = bert.BertForSequenceClassification(TINY, sparsity="2:4", num_labels=3, dtype=dtype)
    variables = model.init(jax.random.key(0), _ids())
    logits = model.apply(variables, _ids(), attention_mask=jnp.ones((2, 8), jnp.int32))
    assert logits.shape == (2, 3) and logits.dtype == jnp.float32
    flat = traverse_util.flatten_dict(variables["params"])
    kernels = {p[2:-1] for p in flat if p[-1] == "kernel" and p[1].startswith("encoder_layer_")}
    assert kernels == LINEARS
    selected = pruning.gmp_prune("2:4").init(variables["params"]).masks
    chosen = {p for p, m in traverse_util.flatten_dict(selected).items() if m is not None}
    assert len(chosen) == 6 * TINY.num_hidden_layers  # Q, K, V, attn out, FFN in, FFN out per layer
    assert all(p[1].startswith("encoder_layer_") for p in chosen)  # no embeddings, pooler, classifier


def test_masks_change_the_encoder_output():
    model = bert.BertForSequenceClassification(TINY, sparsity="2:4", num_labels=2)
    params = model.init(jax.random.key(0), _ids())["params"]
    masks = pruning.oneshot_masks(params, "2:4")
    dense = model.apply({"params": params}, _ids())
    sparse = model.apply(pruning.model_variables(params, masks=masks), _ids())
    pruned = jax.tree_util.tree_map(lambda p, m: p if m is None else p * m, params, masks, is_leaf=lambda x: x is None)
    explicit = model.apply({"params": pruned}, _ids())
    np.testing.assert_allclose(sparse, explicit, rtol=1e-5, atol=1e-5)
    assert not np.allclose(sparse, dense)


def test_padding_does_not_change_real_tokens():
    model = bert.BertModel(TINY, add_pooler=False)
    ids = _ids(1, 6)
    params = jax.jit(model.init)(jax.random.key(0), ids)["params"]
    h_short, _ = jax.jit(model.apply)({"params": params}, ids)
    padded = jnp.concatenate([ids, jnp.zeros((1, 10), ids.dtype)], 1)
    mask = jnp.concatenate([jnp.ones((1, 6), jnp.int32), jnp.zeros((1, 10), jnp.int32)], 1)
    h_long, _ = jax.jit(model.apply)({"params": params}, padded, attention_mask=mask)
    np.testing.assert_allclose(h_long[:, :6], h_short, rtol=1e-5, atol=1e-5)


def _to_hf(params: dict, cfg: bert.BertConfig) -> dict[str, np.ndarray]:
    """Write our params under Hugging Face names (the inverse of params_from_hf), old-style names for LayerNorm."""
    flat = traverse_util.flatten_dict(params)
    out = {}
    for path, (name, transpose) in bert._hf_names(cfg).items():
        value = np.asarray(flat[path])
        out["bert." + name.replace("LayerNorm.weight", "LayerNorm.gamma")] = value.T if transpose else value
    return out


def test_hf_name_mapping_round_trip_and_errors():
    model = bert.BertModel(TINY)
    params = model.init(jax.random.key(0), _ids())["params"]
    hf = _to_hf(params, TINY)
    assert "bert.encoder.layer.1.attention.self.query.weight" in hf
    back = bert.params_from_hf(hf, TINY)
    for path, value in traverse_util.flatten_dict(params).items():
        np.testing.assert_array_equal(traverse_util.flatten_dict(back)[path], value)
    del hf["bert.encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match="encoder.layer.1.output.dense.bias"):
        bert.params_from_hf(hf, TINY)


def test_config_from_hf_and_bad_configs(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, '
                    '"num_hidden_layers": 1, "intermediate_size": 128, "architectures": ["BertModel"]}')
    cfg = bert.BertConfig.from_hf(path)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (64, 4, 1)
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        bert.BertConfig(hidden_size=100, num_attention_heads=12)
    with pytest.raises(ValueError, match="not 'bert'"):
        bert.BertConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="preset must be one of"):
        bert.BertConfig.preset("huge")
    assert bert.BertConfig.preset("large").intermediate_size == 4096


@pytest.fixture(scope="module")
def minilm():
    try:
        cfg, params = bert.load_minilm()
        tok = data.load_tokenizer()
    except data.MissingPackageError as e:
        pytest.skip(f"pretrained weights not installed: {e}")
    return cfg, params, tok


def _embed(cfg, params, tok, sentences, max_len=32, variables_extra=None, model=None):
    model = model or bert.BertModel(cfg, add_pooler=False)
    batch = data.tokenize(tok, data.Split(tuple(sentences), np.zeros(len(sentences), np.int32)), max_len)
    variables = {"params": params, **(variables_extra or {})}
    h, _ = jax.jit(model.apply)(variables, batch.input_ids, batch.token_type_ids, batch.attention_mask)
    e = bert.mean_pool(h, batch.attention_mask)
    return np.asarray(e / jnp.linalg.norm(e, axis=-1, keepdims=True))


SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "A monkey is playing drums.", "Someone in a gorilla costume is playing a set of drums.",
             "The new movie is awesome.", "The cat sits outside."]


def test_minilm_loads_and_embeds_related_sentences_close(minilm):
    cfg, params, tok = minilm
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (6, 384, 12, 30522)
    e = _embed(cfg, params, tok, SENTENCES)
    sim = e @ e.T
    for a, b in ((0, 1), (2, 3)):  # paraphrase pairs
        unrelated = [sim[a, j] for j in range(len(SENTENCES)) if j not in (a, b)]
        assert sim[a, b] > 0.55, sim[a, b]
        assert sim[a, b] > max(unrelated) + 0.3, (sim[a, b], unrelated)
    assert abs(sim[0, 2]) < 0.3 and abs(sim[1, 5]) < 0.3
    # padding is masked: the same sentences at a longer length embed the same
    np.testing.assert_allclose(_embed(cfg, params, tok, SENTENCES, max_len=64), e, atol=1e-4)


def test_minilm_merges_into_the_classifier(minilm):
    cfg, params, tok = minilm
    model = bert.BertForSequenceClassification(cfg, sparsity="2:4", num_labels=2)
    init = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    merged = bert.merge_params(init, params)
    np.testing.assert_array_equal(merged["bert"]["encoder_layer_3"]["attention"]["query"]["kernel"],
                                  params["encoder_layer_3"]["attention"]["query"]["kernel"])
    np.testing.assert_array_equal(merged["classifier"]["kernel"], init["classifier"]["kernel"])
    with pytest.raises(ValueError, match="has no place"):
        bert.merge_params(init, {"pooler": params["encoder_layer_0"]["output"]})
    # one-shot 2:4 masks over the loaded encoder obey the pattern
    masks = pruning.oneshot_masks(merged, "2:4")
    assert all(fmt.check_mask(m, "2:4") for m in jax.tree_util.tree_leaves(masks))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_attention_matches_the_softmax_attention(dtype):
    """attention_impl='fused' computes BERT's attention (padding mask included), in its gradient too."""
    base = dataclasses.replace(TINY, attention_probs_dropout_prob=0.0)
    fused = dataclasses.replace(base, attention_impl="fused")
    ids = _ids(2, 12)
    mask = jnp.ones((2, 12), jnp.int32).at[1, 7:].set(0)
    model, fused_model = bert.BertModel(base, dtype=dtype), bert.BertModel(fused, dtype=dtype)
    params = model.init(jax.random.key(1), ids)["params"]

    def loss(m, p):
        h, pooled = m.apply({"params": p}, ids, attention_mask=mask)
        return jnp.sum(h[:, :7].astype(jnp.float32) ** 2) + jnp.sum(pooled.astype(jnp.float32))

    want, got = jax.jit(model.apply)({"params": params}, ids, attention_mask=mask), \
        jax.jit(fused_model.apply)({"params": params}, ids, attention_mask=mask)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=tol, atol=tol)
    g_want = jax.grad(lambda p: loss(model, p))(params)
    g_got = jax.grad(lambda p: loss(fused_model, p))(params)
    flat_got, flat_want = (jnp.concatenate([x.astype(jnp.float32).ravel() for x in jax.tree_util.tree_leaves(g)])
                           for g in (g_got, g_want))
    assert bool(jnp.all(jnp.isfinite(flat_got)))
    assert float(jnp.linalg.norm(flat_got - flat_want) / jnp.linalg.norm(flat_want)) <= tol


def test_fused_attention_refuses_probability_dropout():
    with pytest.raises(ValueError, match="attention_probs_dropout_prob=0"):
        dataclasses.replace(TINY, attention_impl="fused")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        dataclasses.replace(TINY, attention_probs_dropout_prob=0.0, attention_impl="flash")


@pytest.mark.gpu
def test_fused_attention_runs_cudnn_on_the_gpu():
    """On the GPU, bf16 fused attention is one cuDNN call (no [B, H, T, T] softmax) and matches BERT's."""
    test_fused_attention_matches_the_softmax_attention(jnp.bfloat16)
    q = k = v = jax.random.normal(jax.random.key(0), (2, 128, 4, 64), jnp.bfloat16)
    lengths = jnp.array([128, 77], jnp.int32)
    hlo = jax.jit(bert.fused_attention).lower(q, k, v, lengths).compile().as_text()
    assert "__cudnn$fmha" in hlo
    # the padding goes to cuDNN as lengths: no bias operand, so the backward computes no bias gradient
    grad_hlo = jax.jit(jax.grad(lambda q: jnp.sum(bert.fused_attention(q, k, v, lengths).astype(jnp.float32))))
    text = grad_hlo.lower(q).compile().as_text()
    assert "__cudnn$fmhaSoftmaxBackward" in text and "__cudnn$fmhaScaleBias" not in text


def test_fused_attention_masks_by_key_length():
    """The fused attention's padding: keys at and after each row's length take no weight, every query attends;
    the same numbers as the softmax over an additive key mask."""
    q, k, v = (jax.random.normal(key, (3, 10, 2, 8), jnp.float32) for key in jax.random.split(jax.random.key(0), 3))
    lengths = jnp.array([10, 4, 1], jnp.int32)
    got = bert.fused_attention(q, k, v, lengths)
    bias = jnp.where(jnp.arange(10)[None, :] < lengths[:, None], 0.0, -1e9)[:, None, None, :]
    probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8) + bias, axis=-1)
    want = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # a key past the length does not move any output
    moved = bert.fused_attention(q, k.at[1, 6].set(100.0), v.at[1, 6].set(100.0), lengths)
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(got))


def test_key_lengths_of_right_padding():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 1, 1]])
    lengths, is_prefix = bert.key_lengths_of(mask)
    np.testing.assert_array_equal(lengths, [3, 1, 1, 2, 3])
    np.testing.assert_array_equal(is_prefix, [True, True, True, False, False])


def test_fused_attention_gives_nan_for_a_mask_that_is_not_right_padding():
    """Padding masked by length needs 1s then 0s in each row; another mask poisons that row, never a silent
    wrong answer, and leaves the other rows as the softmax attention computes them."""
    base = dataclasses.replace(TINY, attention_probs_dropout_prob=0.0)
    fused = dataclasses.replace(base, attention_impl="fused")
    ids = _ids(2, 12)
    mask = jnp.ones((2, 12), jnp.int32).at[1, 3].set(0)  # row 1 has a hole
    params = bert.BertModel(base).init(jax.random.key(1), ids)["params"]
    got, _ = bert.BertModel(fused).apply({"params": params}, ids, attention_mask=mask)
    want, _ = bert.BertModel(base).apply({"params": params}, ids, attention_mask=mask)
    assert bool(jnp.all(jnp.isnan(got[1])))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_compressed_feed_forward_runs_as_one_sparse_mlp(hidden_act):
    """With compressed layers the FFN is one ``jaxsparse.ops.sparse_mlp`` (``fuse_feed_forward``, the default): the
    same parameters, logits and gradients as the two layers and the activation it replaces."""
    cfg = bert.BertConfig.preset("tiny", hidden_act=hidden_act)
    ids = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    models = [bert.BertForSequenceClassification(dataclasses.replace(cfg, fuse_feed_forward=fuse), sparsity="64:2:8",
                                                 compressed=True, num_labels=3) for fuse in (True, False)]
    variables = [m.init(jax.random.key(1), ids) for m in models]
    assert jax.tree_util.tree_structure(variables[0]) == jax.tree_util.tree_structure(variables[1])
    v = variables[0]

    def loss(params, model):
        return jnp.sum(jnp.sin(model.apply({**v, "params": params}, ids)))

    (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(v["params"], m) for m in models)
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
