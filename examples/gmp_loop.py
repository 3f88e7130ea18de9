"""The whole sparse-training loop in one page: NMDense + gmp_prune, then compressed training.

1. Build a model with ``NMDense`` where it had ``nn.Dense`` (here a small MLP on a synthetic task).
2. Chain ``gmp_prune`` *last* after the optimizer. Its state holds the masks -- the single source of
   truth -- and ``model_variables(params, opt_state)`` hands them to the model on every step.
3. The cubic schedule walks the ladder 2:4 -> 32:2:8 -> 32:2:16; masks change only at the stage steps and
   pruned weights are exactly zero after every update.
4. Once the last (N = 2) stage is in place, convert: the params become the compressed ``values`` (the
   ``"sparsity"`` collection keeps the fixed pattern), Adam's moments are gathered the same way, and
   training goes on with ``sparse_linear`` -- no dense gradient, no dense optimizer state.

Run: ``python examples/gmp_loop.py`` (CPU, a few seconds).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxsparse import format as fmt
from jaxsparse.nn import NMDense
from jaxsparse.pruning import gmp_prune, masks_of, model_variables, sparsity_of, to_compressed


class MLP(nn.Module):
    sparsity: str = "32:2:16"
    compressed: bool = False

    @nn.compact
    def __call__(self, x):
        enc = dict(sparsity=self.sparsity, compressed=self.compressed)
        h = nn.relu(NMDense(128, **enc, name="encoder_in")(x))
        h = nn.relu(NMDense(128, **enc, name="encoder_out")(h))
        return nn.Dense(4, name="classifier")(h)  # not pruned by the default filter


def make_data(key, n=2048, k=128):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, k))
    teacher = jax.random.normal(kw, (k, 4))
    return x, jnp.argmax(jnp.tanh(x @ teacher), -1)


def main(steps: int = 300, begin: int = 30, end: int = 180) -> dict:
    x, y = make_data(jax.random.key(0))
    model = MLP()
    params = model.init(jax.random.key(1), x[:1])["params"]
    prune = gmp_prune("32:2:16", begin_step=begin, end_step=end, frequency=10)
    adamw = optax.adamw(3e-3, weight_decay=1e-4)
    tx = optax.chain(adamw, prune)
    opt_state = tx.init(params)
    print("ladder", [str(s) for s in prune.schedule.ladder], "starts at steps", prune.schedule.stage_steps)

    def loss_fn(p, variables, xb, yb):
        logits = model.apply({**variables, "params": p}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(params, opt_state, xb, yb):
        variables = model_variables(params, opt_state)  # masks: read from the optimizer state
        loss, grads = jax.value_and_grad(loss_fn)(params, variables, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for t in range(steps):
        lo = (t * 64) % x.shape[0]
        params, opt_state, loss = step(params, opt_state, x[lo:lo + 64], y[lo:lo + 64])
        if t in prune.schedule.stage_steps or t % 50 == 0:
            masks = masks_of(opt_state)
            stage = prune.schedule.stage_at(t)
            spec = prune.schedule.ladder[stage - 1] if stage else None
            ok = spec is None or all(fmt.check_mask(m, spec) for m in jax.tree_util.tree_leaves(masks))
            print(f"step {t:4d} loss {float(loss):.3f} stage {spec} sparsity {sparsity_of(params, masks):.3f} "
                  f"mask ok {ok}")

    # Final N = 2 pattern reached: switch to compressed training.
    final = prune.schedule.ladder[-1]
    # opt_state[0] is adamw's state: its moments are gathered into the values layout too.
    c_params, pattern, c_state = to_compressed(params, masks_of(opt_state), final, opt_state[0])
    c_tx = adamw  # the same optimizer, now over the compressed values
    c_model = MLP(compressed=True)

    @jax.jit
    def c_step(p, s, xb, yb):
        def loss_c(p):
            logits = c_model.apply({"params": p, "sparsity": pattern}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_c)(p)
        updates, s = c_tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    for t in range(steps, steps + 50):
        lo = (t * 64) % x.shape[0]
        c_params, c_state, loss = c_step(c_params, c_state, x[lo:lo + 64], y[lo:lo + 64])
    print(f"compressed training: step {t} loss {float(loss):.3f}; encoder_in values "
          f"{c_params['encoder_in']['values'].shape} vs dense kernel {params['encoder_in']['kernel'].shape}")
    acc = float((jnp.argmax(c_model.apply({"params": c_params, "sparsity": pattern}, x), -1) == y).mean())
    print(f"train accuracy {acc:.3f}")
    return {"loss": float(loss), "accuracy": acc}


if __name__ == "__main__":
    main()
