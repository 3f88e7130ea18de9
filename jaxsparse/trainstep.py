"""One jitted BERT training step (forward, backward, AdamW) for the profiler and the step benchmark.

Mixed precision as in training: float32 master parameters and AdamW moments, computation in ``dtype``
(bf16 on a GPU). Sparse layers run in one of two modes:

* ``compressed``: the model is built with ``NMDense(compressed=True)``; its parameters are the
  compressed values (reached from magnitude masks through :func:`jaxsparse.pruning.to_compressed`),
  the fixed pattern is passed as the ``"sparsity"`` collection, and the optimizer is plain AdamW.
* ``masked``: dense kernels, masks in the optimizer state (``optax.chain(adamw, gmp_prune(...))``,
  one-shot at step 0), the masked-dense product: what the format cannot compress runs this way.

The AdamW update runs inside ``jax.named_scope("optimizer")`` so that the profiler can attribute its
fusions (their HLO ``op_name`` metadata starts with ``jit(step)/optimizer/``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsparse import format as fmt
from jaxsparse import parallel, pruning
from jaxsparse.models import bert
from jaxsparse.train import OPTIMIZER_SCOPE, make_step

__all__ = ["StepConfig", "TrainStep", "MODELS", "OPTIMIZER_SCOPE", "sparse_mode", "build_step", "adamw"]

MODELS = tuple(bert.PRESETS)


HEADLINE_BATCH = {  # (model, seq_len): batch size on an 80 GB H100 (f32 master + AdamW, no rematerialization)
    ("base", 512): 64,
    ("base", 128): 256,
    ("large", 512): 32,
    ("large", 128): 128,
}
"""The batch sizes of the headline benchmark (``benchmarks/train_step.py``), by ``(model, seq_len)``, chosen with the
benchmark's first version (BERT's softmax attention). With cuDNN attention (``attention="fused"``) BERT-large at
sequence 512 peaks at 23.4 GiB at batch 32 and fills an 80 GB H100 at batch 96 (61.3 GiB; docs/results.md,
session 40)."""


def default_batch_size(model: str, seq_len: int) -> int:
    """:data:`HEADLINE_BATCH`'s batch for ``(model, seq_len)``, so that a profile or a step measures what the
    headline benchmark does; 8 for the shapes it does not run."""
    return HEADLINE_BATCH.get((model, seq_len), 8)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What to build.

    Attributes:
      model: a BERT preset (``tiny``, ``mini``, ``minilm``, ``base``, ``large``, ...).
      sparsity: ``"dense"`` or a V:N:M pattern of the encoder projections.
      batch_size, seq_len: the batch (tokens = batch_size * seq_len).
      dtype: computation dtype; parameters and optimizer state stay float32.
      compressed: True = compressed mode (``ValueError`` if the shapes do not allow it), False = masked
        dense, None = compressed where the format allows it, masked-dense otherwise.
      seed: parameter and data seed.
      attention: ``"softmax"`` (BERT's own attention, dropout on the probabilities) or ``"fused"``
        (:func:`jaxsparse.models.bert.fused_attention`: cuDNN flash attention on a GPU, no dropout on
        the probabilities; the hidden dropouts stay).
      transposable: choose transposable masks (``jaxsparse.format.select_mask``'s option). The input gradient
        takes the ``"transposed"`` route only where ``JAXSPARSE_DX=transposed`` is set when the step is traced
        (``benchmarks/train_step.py --transposable`` sets it).
      exclusive_columns: choose column-exclusive masks (``select_mask``'s option; ``N <= 2``, ``M > 4``), for the
        ``"blocks"`` input gradient (``benchmarks/train_step.py --exclusive-columns`` traces with it).
      fuse_feed_forward: :attr:`jaxsparse.models.bert.BertConfig.fuse_feed_forward` (compressed FFNs as one
        :func:`jaxsparse.ops.sparse_mlp`, the activation in the kernels' epilogues).
      diagonal_ffn_out: the FFN out kernels as ``M / 4`` diagonal 2:4 blocks (``V:2:M`` with ``M >= 8``; masks by
        ``jaxsparse.format.select_diagonal_mask``, the hidden units relabelled by ``jaxsparse.pruning.to_compressed``;
        ``BertConfig.diagonal_ffn_out``).
      diagonal_all: every encoder kernel as ``M / 4`` diagonal 2:4 blocks read through chunk tables (no relabelling;
        ``V`` a multiple of 64; ``BertConfig.diagonal_all``).
      diagonal_ffn: as ``diagonal_all`` for the FFN's two kernels only (``BertConfig.diagonal_ffn``).
      dropout: ``"hash"`` (:class:`jaxsparse.dropout.HashDropout`, keep bits hashed inside the kernels that use
        them; the default, as ``BertConfig``'s: 2.9-3.5 ms off the dense BERT-large step on an H200, 1.4-2.1 ms off
        the sparse ones) or ``"rng"`` (``flax.linen.Dropout``); ``BertConfig.dropout_impl``.
      devices: 1 = the single-device step; ``n > 1`` = data parallel over this process's first ``n`` devices
        (:func:`jaxsparse.parallel.data_parallel`: ``batch_size`` is the global batch, split evenly, and the
        gradients, dense kernels or compressed values, are all-reduced once a step).
    """

    model: str = "tiny"
    sparsity: str = "dense"
    batch_size: int = 8
    seq_len: int = 128
    dtype: str = "bfloat16"
    compressed: bool | None = None
    seed: int = 0
    attention: str = "softmax"
    transposable: bool = False
    fuse_feed_forward: bool = True
    exclusive_columns: bool = False
    diagonal_ffn_out: bool = False
    diagonal_all: bool = False
    diagonal_ffn: bool = False
    dropout: str = "hash"
    devices: int = 1

    def __post_init__(self) -> None:
        if self.model not in bert.PRESETS:
            raise ValueError(f"model must be one of {sorted(bert.PRESETS)}, got {self.model!r}")
        if self.sparsity != "dense":
            fmt.VNM.parse(self.sparsity)  # ValueError naming the format
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {self.batch_size}, {self.seq_len}")
        if self.devices < 1 or self.batch_size % self.devices:
            raise ValueError(f"devices must be >= 1 and divide batch_size (the global batch), got devices="
                             f"{self.devices}, batch_size={self.batch_size}")
        jnp.dtype(self.dtype)
        if self.attention not in bert.ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {bert.ATTENTION_IMPLS}, got {self.attention!r}")
        if self.dropout not in bert.DROPOUT_IMPLS:
            raise ValueError(f"dropout must be one of {bert.DROPOUT_IMPLS}, got {self.dropout!r}")
        if self.transposable and self.sparsity == "dense":
            raise ValueError("transposable masks need a sparse pattern, not 'dense'")
        if self.exclusive_columns:
            if self.sparsity == "dense":
                raise ValueError("exclusive columns need a V:N:M pattern with N <= 2 and M > 4, not 'dense'")
            fmt.check_exclusive_spec(self.sparsity)
        if self.diagonal_ffn_out:
            if self.sparsity == "dense":
                raise ValueError("diagonal FFN out blocks need a V:2:M pattern with M >= 8, not 'dense'")
            fmt.diagonal_blocks(self.sparsity)  # ValueError naming the constraint
        if self.diagonal_all or self.diagonal_ffn:
            if self.sparsity == "dense" or sum((self.diagonal_ffn_out, self.diagonal_ffn, self.diagonal_all)) > 1:
                raise ValueError("chunk-table diagonal blocks (diagonal_ffn, diagonal_all) need a V:2:M pattern with "
                                 "M >= 8 (not 'dense') and no other diagonal option (each includes FFN out)")
            fmt.chunked_diagonal_blocks(self.sparsity)  # ValueError naming the constraint

    def dx_route(self) -> str | None:
        """The input-gradient route the masks are chosen for: ``"blocks"`` for column-exclusive masks,
        ``"transposed"`` for transposable ones, None (``JAXSPARSE_DX`` as set) otherwise; trace the step inside
        ``jaxsparse.ops.dx_route_scope(config.dx_route())``."""
        return "blocks" if self.exclusive_columns else "transposed" if self.transposable else None

    def bert_config(self) -> bert.BertConfig:
        """The preset's :class:`~jaxsparse.models.bert.BertConfig` with this attention, layout and dropout."""
        fused = dict(attention_probs_dropout_prob=0.0, attention_impl="fused") if self.attention == "fused" else {}
        return bert.BertConfig.preset(self.model, fuse_feed_forward=self.fuse_feed_forward,
                                      diagonal_ffn_out=self.diagonal_ffn_out, diagonal_all=self.diagonal_all,
                                      diagonal_ffn=self.diagonal_ffn, dropout_impl=self.dropout, **fused)


@dataclasses.dataclass
class TrainStep:
    """A built step: ``params, opt_state, loss = fn(*args)``; feed the outputs back as the next inputs.

    Attributes:
      fn: the jitted step ``(params, opt_state, extra, batch, rng) -> (params, opt_state, loss)``
        (params and opt_state donated).
      args: its first arguments.
      mode: ``dense``, ``compressed`` or ``masked``.
      reason: why masked-dense was used ("" otherwise).
      config: the :class:`StepConfig`.
      bert_config: the model's :class:`~jaxsparse.models.bert.BertConfig`.
    """

    fn: Callable
    args: tuple
    mode: str
    reason: str
    config: StepConfig
    bert_config: bert.BertConfig

    @property
    def tokens(self) -> int:
        return self.config.batch_size * self.config.seq_len

    def run(self, steps: int = 1) -> jax.Array:
        """Run ``steps`` steps, carrying params and optimizer state; returns the last loss (not synced)."""
        params, state, *rest = self.args
        loss = None
        for _ in range(steps):
            params, state, loss = self.fn(params, state, *rest)
        self.args = (params, state, *rest)
        return loss


def adamw() -> optax.GradientTransformation:
    """AdamW as ``jaxsparse-train`` uses it (no decay on vectors)."""
    return optax.adamw(1e-4, weight_decay=0.01, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))


def sparse_mode(cfg: bert.BertConfig, sparsity: str, compressed: bool | None = None) -> tuple[str, str]:
    """``(mode, reason)`` for ``sparsity`` on a BERT of ``cfg``: see :class:`StepConfig.compressed`."""
    if sparsity == "dense":
        return "dense", ""
    spec = fmt.VNM.parse(sparsity)
    if compressed is False:
        return "masked", "asked for masked-dense"
    problem = cfg.compressed_problem(spec)
    if problem:
        if compressed:
            raise ValueError(f"compressed mode impossible for {sparsity} on hidden {cfg.hidden_size}: {problem}")
        return "masked", problem
    return "compressed", ""


def build_step(config: StepConfig) -> TrainStep:
    """Build the model, its parameters, optimizer state and a random batch, and jit the step."""
    cfg = config.bert_config()
    mode, reason = sparse_mode(cfg, config.sparsity, config.compressed)
    dtype = jnp.dtype(config.dtype)
    sparsity = None if mode == "dense" else config.sparsity
    key = jax.random.key(config.seed)
    k_init, k_ids, k_lab = jax.random.split(key, 3)
    b, t = config.batch_size, config.seq_len
    ids = jax.random.randint(k_ids, (b, t), 0, cfg.vocab_size, jnp.int32)
    batch = (ids, jnp.zeros_like(ids), jnp.ones_like(ids), jax.random.randint(k_lab, (b,), 0, 2, jnp.int32))

    def make(compressed: bool):
        return bert.BertForSequenceClassification(cfg, sparsity=sparsity, compressed=compressed, dtype=dtype,
                                                  num_labels=2)

    master = make(False)
    params = jax.jit(master.init)(k_init, ids[:1, :8])["params"]
    base = adamw()
    diagonal_fn, diagonal_chunks = cfg.diagonal_kernels()
    if mode == "compressed":
        masks = pruning.oneshot_masks(params, config.sparsity, transposable=config.transposable,
                                      exclusive_columns=config.exclusive_columns, diagonal_fn=diagonal_fn)
        params, pattern, opt_state = pruning.to_compressed(params, masks, config.sparsity, base.init(params),
                                                           diagonal_fn=diagonal_fn, diagonal_chunks=diagonal_chunks)
        model, tx, extra, with_masks = make(True), base, {"sparsity": pattern}, False
    elif mode == "masked":
        tx = optax.chain(base, pruning.gmp_prune([config.sparsity], 0, 0, transposable=config.transposable,
                                                 exclusive_columns=config.exclusive_columns, diagonal_fn=diagonal_fn))
        opt_state = tx.init(params)
        model, extra, with_masks = master, {}, True
    else:
        model, tx, extra, with_masks = master, base, {}, False
        opt_state = tx.init(params)

    mesh = parallel.local_mesh(config.devices) if config.devices > 1 else None
    fn = make_step(model, tx, with_masks, mesh=mesh, donate=True)
    rng = jax.random.key(config.seed + 1, impl="rbg")
    if mesh is not None:  # resident on every device once, not copied there at every step
        params, opt_state, extra, rng = parallel.replicate((params, opt_state, extra, rng), mesh)
        batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(parallel.DATA_AXIS)))
    if mode == "masked":  # the one-shot mask is set by the first update: take it before timing
        params, opt_state, _ = fn(params, opt_state, extra, batch, rng)
    return TrainStep(fn, (params, opt_state, extra, batch, rng), mode, reason, config, cfg)


def count_params(tree: Any) -> int:
    """Number of scalars in a pytree of arrays."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
