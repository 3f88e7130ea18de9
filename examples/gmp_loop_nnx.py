"""The sparse-training loop of ``examples/gmp_loop.py`` in Flax NNX: NMLinear + gmp_prune, then compressed training.

1. Build a model with ``jaxsparse.nnx.NMLinear`` where it had ``nnx.Linear`` (a small MLP on a synthetic task).
2. Chain ``gmp_prune`` *last* in the optimizer and make it an ``nnx.Optimizer(model, tx, wrt=nnx.Param)``. Its state
   holds the masks -- the single source of truth -- and ``set_masks(model, masks_of(optimizer.opt_state))`` hands
   them to the layers after each update (a mask is a ``Mask`` variable: state, not a parameter).
3. The cubic schedule walks the ladder 2:4 -> 32:2:8 -> 32:2:16; masks change only at the stage steps and pruned
   weights are exactly zero after every update.
4. Once the last (N = 2) stage is in place, ``compress_model`` makes each layer's compressed ``values`` the parameter
   (the fixed pattern stays as ``Mask`` state) and returns the optimizer that trains on with ``sparse_linear`` -- no
   dense gradient, no dense optimizer state; Adam's moments and step count carry over into the values layout.

Run: ``python examples/gmp_loop_nnx.py`` (CPU, a few seconds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxsparse import format as fmt
from jaxsparse.nnx import NMLinear, compress_model, set_masks
from jaxsparse.pruning import gmp_prune, masks_of


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, sparsity: str = "32:2:16", k: int = 128):
        self.encoder_in = NMLinear(k, 128, sparsity=sparsity, rngs=rngs)
        self.encoder_out = NMLinear(128, 128, sparsity=sparsity, rngs=rngs)
        self.classifier = nnx.Linear(128, 4, rngs=rngs)  # not pruned by the default filter

    def __call__(self, x):
        return self.classifier(jax.nn.relu(self.encoder_out(jax.nn.relu(self.encoder_in(x)))))


def make_data(key, n=2048, k=128):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, k))
    teacher = jax.random.normal(kw, (k, 4))
    return x, jnp.argmax(jnp.tanh(x @ teacher), -1)


def loss_fn(model, xb, yb):
    return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb).mean()


@nnx.jit
def train_step(model, optimizer, xb, yb):
    loss, grads = nnx.value_and_grad(loss_fn)(model, xb, yb)
    optimizer.update(model, grads)
    return loss


def main(steps: int = 300, begin: int = 30, end: int = 180) -> dict:
    x, y = make_data(jax.random.key(0))
    model = MLP(nnx.Rngs(1))
    prune = gmp_prune("32:2:16", begin_step=begin, end_step=end, frequency=10)
    adamw = optax.adamw(3e-3, weight_decay=1e-4)
    optimizer = nnx.Optimizer(model, optax.chain(adamw, prune), wrt=nnx.Param)
    print("ladder", [str(s) for s in prune.schedule.ladder], "starts at steps", prune.schedule.stage_steps)
    layers = (model.encoder_in, model.encoder_out)
    for t in range(steps):
        lo = (t * 64) % x.shape[0]
        loss = train_step(model, optimizer, x[lo:lo + 64], y[lo:lo + 64])
        set_masks(model, masks_of(optimizer.opt_state))  # the optimizer's masks, into the layers
        if t in prune.schedule.stage_steps or t % 50 == 0:
            stage = prune.schedule.stage_at(t)
            spec = prune.schedule.ladder[stage - 1] if stage else None
            ok = spec is None or all(fmt.check_mask(layer.mask.get_value(), spec) for layer in layers)
            kept = sum(int(jnp.count_nonzero(layer.kernel.get_value())) for layer in layers)
            print(f"step {t:4d} loss {float(loss):.3f} stage {spec} "
                  f"sparsity {1 - kept / sum(layer.kernel.get_value().size for layer in layers):.3f} mask ok {ok}")

    # Final N = 2 pattern reached: switch to compressed training.
    dense_shape = model.encoder_in.kernel.get_value().shape
    # The same AdamW over the compressed values, its state (opt_state[0]: the chain's first part) carried over.
    optimizer = compress_model(model, adamw, optimizer.opt_state[0])
    for t in range(steps, steps + 50):
        lo = (t * 64) % x.shape[0]
        loss = train_step(model, optimizer, x[lo:lo + 64], y[lo:lo + 64])
    print(f"compressed training: step {t} loss {float(loss):.3f}; encoder_in values "
          f"{model.encoder_in.values.get_value().shape} vs dense kernel {dense_shape}")
    acc = float((jnp.argmax(model(x), -1) == y).mean())
    print(f"train accuracy {acc:.3f}")
    return {"loss": float(loss), "accuracy": acc}


if __name__ == "__main__":
    main()
