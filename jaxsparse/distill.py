"""The losses of distillation from a dense teacher, and the unlabelled batch variants it also runs on.

``jaxsparse-train --distill W`` trains the sparse student on ``(1 - W) * CE + W * T^2 * KL`` (:func:`loss_fn`,
:func:`soft_distill_loss`); ``--distill-hidden`` and ``--distill-attention`` add the encoder layers' states
(:func:`hidden_distill_loss`) and attention distributions (:func:`attention_distill_loss`) of the teacher run inside
the step; ``--distill-augment`` also distils on a corrupted copy of each batch (:func:`augment_tokens`), whose
replacement tokens ``--augment-neighbors`` draws from each word piece's nearest neighbours (:func:`token_neighbors`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["loss_fn", "soft_distill_loss", "hidden_distill_loss", "attention_distill_loss", "augment_tokens",
           "token_neighbors"]


def loss_fn(logits: jax.Array, labels: jax.Array, teacher_logits: jax.Array | None = None,
            distill: float = 0.0, temperature: float = 2.0) -> jax.Array:
    """Mean cross-entropy, or with a teacher ``(1 - distill) * CE + distill * T^2 * KL(teacher_T || student_T)``.

    ``T^2`` keeps the soft term's gradient on the scale of the hard one (Hinton et al.); the KL is over
    the temperature-softened distributions, so a student equal to its teacher has a zero soft term.
    """
    logits = logits.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    if teacher_logits is None or distill == 0.0:
        return ce
    return (1.0 - distill) * ce + distill * soft_distill_loss(logits, teacher_logits, temperature)


def soft_distill_loss(logits: jax.Array, teacher_logits: jax.Array, temperature: float) -> jax.Array:
    """``T^2 * KL(teacher_T || student_T)``, mean over the batch, of temperature-``T`` softened logits."""
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature)
    st = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature)
    return temperature**2 * (jnp.exp(t) * (t - st)).sum(-1).mean()


def _inner_tokens(attention_mask: jax.Array) -> jax.Array:
    """``[B, T]`` bool: the real tokens (``attention_mask`` 1) except each row's first and last real token
    (``[CLS]`` and ``[SEP]`` of a single-segment example)."""
    real = attention_mask > 0
    after = jnp.concatenate([real[:, 1:], jnp.zeros_like(real[:, :1])], axis=1)  # the next position is real
    first = jnp.arange(real.shape[1])[None, :] == 0
    return real & after & ~first


def augment_tokens(key: jax.Array, input_ids: jax.Array, attention_mask: jax.Array, rate: float,
                   neighbors: jax.Array | None = None) -> jax.Array:
    """A corrupted copy of ``input_ids [B, T]`` for distillation on unlabelled variants of the batch.

    The eligible tokens are the real ones (``attention_mask`` 1) except each row's first and last real token
    (``[CLS]`` and ``[SEP]`` of a single-segment example). Each is replaced, independently with probability
    ``rate``: without ``neighbors`` by an eligible token of the same batch drawn uniformly (so replacements
    follow the batch's own word distribution), with ``neighbors [vocab, K]`` (:func:`token_neighbors`) by one
    of the token's ``K`` nearest word pieces drawn uniformly. A row without eligible tokens, and every other
    position, stays as it is.
    """
    eligible = _inner_tokens(attention_mask)
    k_pick, k_src = jax.random.split(key)
    pick = eligible & jax.random.bernoulli(k_pick, rate, input_ids.shape)
    if neighbors is not None:
        choice = jax.random.randint(k_src, input_ids.shape, 0, neighbors.shape[1])
        return jnp.where(pick, neighbors[input_ids, choice], input_ids)
    flat_ok = eligible.reshape(-1)
    src = jax.random.categorical(k_src, jnp.where(flat_ok, 0.0, -jnp.inf), shape=input_ids.shape)
    return jnp.where(pick & flat_ok.any(), input_ids.reshape(-1)[src], input_ids)


def token_neighbors(embedding: jax.Array, input_ids: np.ndarray, attention_mask: np.ndarray, k: int,
                    chunk: int = 2048) -> np.ndarray:
    """``[vocab, k]`` int32: each word piece's ``k`` nearest word pieces, for :func:`augment_tokens`.

    The candidates are the word pieces that occur as inner tokens of ``input_ids [N, T]`` (the positions
    :func:`augment_tokens` may replace: real tokens but the first and last of each row); a candidate's row
    lists the ``k`` other candidates with the largest cosine similarity of their rows of ``embedding
    [vocab, hidden]`` (the model's input word embeddings), most similar first. Every other row holds its own id
    ``k`` times, so such a token is never changed. Raises ``ValueError`` when there are not more than ``k``
    candidates, or when a token id lies outside the embedding's rows.
    """
    vocab = embedding.shape[0]
    ids = np.asarray(input_ids)
    cand = np.unique(ids[np.asarray(_inner_tokens(jnp.asarray(attention_mask)))])
    if k < 1 or len(cand) <= k:
        raise ValueError(f"token_neighbors needs 1 <= k < candidates, got k = {k} and {len(cand)} candidate word "
                         f"pieces")
    if cand.min() < 0 or cand.max() >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}) of the embedding, got {cand.min()}..{cand.max()}")
    e = jnp.asarray(embedding, jnp.float32)[jnp.asarray(cand)]
    e = e / jnp.maximum(jnp.linalg.norm(e, axis=1, keepdims=True), 1e-12)

    @jax.jit
    def nearest(q, lo):
        sim = q @ e.T
        sim = jnp.where(jnp.arange(e.shape[0])[None, :] == lo + jnp.arange(q.shape[0])[:, None], -jnp.inf, sim)
        return jax.lax.top_k(sim, k)[1]

    out = np.repeat(np.arange(vocab, dtype=np.int32)[:, None], k, axis=1)
    padded = jnp.concatenate([e, jnp.zeros((-len(cand) % chunk, e.shape[1]), e.dtype)])
    for lo in range(0, len(cand), chunk):
        hi = min(lo + chunk, len(cand))
        out[cand[lo:hi]] = cand[np.asarray(nearest(padded[lo:lo + chunk], lo))[: hi - lo]]
    return out


def hidden_distill_loss(student: Sequence[jax.Array], teacher: Sequence[jax.Array],
                        attention_mask: jax.Array) -> jax.Array:
    """Mean over layers of the squared difference between student and teacher hidden states.

    Each layer's term is ``sum over real tokens of ||h_s - h_t||^2 / (real tokens * hidden size)``: the mean
    squared difference per hidden unit, padding excluded (``attention_mask [B, T]``, 1 = real token). The
    teacher's states get no gradient. Student and teacher must have the same number of layers and shapes.
    """
    if len(student) != len(teacher) or not student:
        raise ValueError(f"hidden_distill_loss needs as many student as teacher layers (>= 1), got "
                         f"{len(student)} and {len(teacher)}")
    m = attention_mask.astype(jnp.float32)[..., None]
    denom = jnp.maximum(m.sum(), 1.0) * student[0].shape[-1]
    terms = [(jnp.square(s.astype(jnp.float32) - jax.lax.stop_gradient(t).astype(jnp.float32)) * m).sum() / denom
             for s, t in zip(student, teacher)]
    return jnp.mean(jnp.stack(terms))


def attention_distill_loss(student: Sequence[jax.Array], teacher: Sequence[jax.Array],
                           attention_mask: jax.Array) -> jax.Array:
    """Mean over layers of ``KL(teacher || student)`` between attention distributions.

    ``student`` and ``teacher`` hold each layer's attention logits ``[B, heads, T, T]``
    (:data:`jaxsparse.models.bert.ATTENTION_LOGITS`: scores with the padding bias, before the softmax). Each
    layer's term is the KL divergence of the two softmax distributions over keys, summed over keys and averaged
    over heads and real query tokens (``attention_mask [B, T]``, 1 = real token); padded keys carry no weight
    in either distribution. The teacher gets no gradient. Student and teacher must have the same number of
    layers (>= 1) and shapes.
    """
    if len(student) != len(teacher) or not student:
        raise ValueError(f"attention_distill_loss needs as many student as teacher layers (>= 1), got "
                         f"{len(student)} and {len(teacher)}")
    q = attention_mask.astype(jnp.float32)[:, None, :]  # [B, 1, T]: real query positions
    denom = jnp.maximum(q.sum(), 1.0) * student[0].shape[1]
    terms = []
    for s, t in zip(student, teacher):
        ls = jax.nn.log_softmax(s.astype(jnp.float32), axis=-1)
        lt = jax.nn.log_softmax(jax.lax.stop_gradient(t).astype(jnp.float32), axis=-1)
        kl = (jnp.exp(lt) * (lt - ls)).sum(-1)  # [B, heads, T]
        terms.append((kl * q).sum() / denom)
    return jnp.mean(jnp.stack(terms))
