"""Data-parallel training over the local devices or several processes, with compressed gradient exchange for
sparse layers.

One process, one 1-D mesh over its devices (:func:`local_mesh`). :func:`data_parallel` turns a
per-device train step ``(params, opt_state, ..., batch, ...) -> (params, opt_state, metrics)`` into a
jitted :func:`jax.shard_map` step: the batch arguments are split along their leading axis, everything
else (params, optimizer state, the ``"sparsity"`` pattern, the PRNG key) is replicated, and the outputs
are replicated. Inside, the step averages its gradients over the mesh axis with :func:`pmean_grads`
*before* the optimizer update, so every device applies the same update and the replicas stay equal::

    def step(params, opt_state, batch, axis=None):        # axis=None: the single-device step
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = pmean_grads(grads, axis)                   # all-reduce over the data axis
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, pmean_grads(loss, axis)

    mesh = local_mesh()
    dp_step = data_parallel(functools.partial(step, axis="data"), mesh, batch_argnums=(2,))

What is exchanged is the gradient pytree, leaf for leaf. In master mode (dense kernels, masks from
``gmp_prune`` in the optimizer state, read by :func:`jaxsparse.pruning.model_variables` inside the
step) a sparse layer's gradient is a dense ``[K, R]`` kernel. In compressed mode (``NMDense(compressed=
True)``) its gradient is ``values``-shaped ``[R, 2K/M]``: the all-reduce carries only the kept values
(25 % of the dense kernel at ``*:2:8``), and the pattern never moves (it is replicated and fixed).
:func:`exchanged_bytes` counts both from the leaves. ``jaxsparse-train --devices N|all`` uses this.

Many hosts: after :func:`jax.distributed.initialize` in every process, :func:`global_mesh` spans every process's
devices and the same :func:`data_parallel` step runs on it. Each process passes its own rows of the global batch
(``batch_size / jax.process_count()`` of them, the same number in each); the step assembles the global batch from
them (:func:`shard_batch`), so no process ever holds another's rows, and returns the replicated outputs, which every
process reads locally. The replicated arguments (params, optimizer state, key) must be equal in every process, as
they are when every process starts from the same seed and runs the same steps::

    jax.distributed.initialize()                      # coordinator, process count and id: arguments or environment
    mesh = global_mesh()
    dp_step = data_parallel(functools.partial(step, axis="data"), mesh, batch_argnums=(2,))
    rows = process_rows(batch_size)                   # this process's slice of each global batch
    params, opt_state, loss = dp_step(params, opt_state, global_batch[rows])
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsparse import pruning

__all__ = ["DATA_AXIS", "local_mesh", "global_mesh", "process_rows", "shard_batch", "replicate", "check_batch",
           "pmean_grads", "data_parallel", "exchanged_bytes", "bert_exchanged_bytes", "main"]

DATA_AXIS = "data"
"""Default name of the data-parallel mesh axis."""

UNPLACED_WARN_LEAVES = 8
""":func:`data_parallel` warns (once, at its second call) about a non-batch argument with more arrays than this
that are not on every device of the mesh: the step copies them there at every call (see :func:`replicate`)."""


def local_mesh(devices: int | str | Sequence[jax.Device] | None = None, axis: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh named ``axis`` over this process's devices.

    Args:
      devices: None or ``"all"`` = every local device; an int ``n`` = the first ``n`` local devices;
        or an explicit sequence of devices.
      axis: the mesh axis name.

    Raises:
      ValueError: ``n < 1``, more devices asked for than exist, or an empty sequence.
    """
    local = jax.local_devices()
    if devices is None or devices == "all":
        chosen = list(local)
    elif isinstance(devices, (int, np.integer)):
        if not 1 <= devices <= len(local):
            raise ValueError(f"asked for {devices} devices, this process has {len(local)} "
                             f"({local[0].platform}); on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                             "(set before JAX starts) makes N host devices")
        chosen = list(local[:devices])
    elif isinstance(devices, str):
        raise ValueError(f"devices must be an int, 'all', a device list or None, got {devices!r}")
    else:
        chosen = list(devices)
        if not chosen:
            raise ValueError("local_mesh: empty device list")
    return Mesh(np.asarray(chosen, dtype=object), (axis,))


def global_mesh(axis: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh named ``axis`` over every device of every process (``jax.devices()``, in process order).

    With one process it is :func:`local_mesh`'s mesh over all local devices. With several (after
    :func:`jax.distributed.initialize`), :func:`data_parallel` over it takes each process's rows of the batch.

    Raises:
      ValueError: the processes do not hold the same number of devices (each would need a different batch share).
    """
    devices = jax.devices()
    per_process = collections.Counter(d.process_index for d in devices)
    if len(set(per_process.values())) > 1:
        raise ValueError(f"global_mesh: the processes hold different numbers of devices {dict(per_process)}; data "
                         "parallelism here splits each batch evenly over processes")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(ordered, dtype=object), (axis,))


def process_rows(batch_size: int, mesh: Mesh | None = None) -> slice:
    """This process's rows of a global batch of ``batch_size`` examples on ``mesh`` (default: every process's
    devices): the ``jax.process_index()``-th of ``jax.process_count()`` equal slices, which :func:`data_parallel`
    expects each process to pass. ``slice(0, batch_size)`` in a single process.

    Raises:
      ValueError: ``batch_size`` is not divisible by the mesh's devices.
    """
    n_dev = mesh.size if mesh is not None else jax.device_count()
    if batch_size % n_dev:
        raise ValueError(f"batch size {batch_size} is not divisible by the {n_dev} devices of the mesh")
    if mesh is not None and not mesh.is_multi_process:
        return slice(0, batch_size)
    per = batch_size // jax.process_count()
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def shard_batch(batch: Any, mesh: Mesh, axis: str = DATA_AXIS) -> Any:
    """The global batch ``jax.Array`` tree, split along its leading axis over ``mesh``, from this process's rows
    (every leaf of ``batch``; :func:`process_rows`): :func:`jax.make_array_from_process_local_data`, leaf for leaf.
    :func:`data_parallel` calls it on a mesh that spans processes; other code can call it to place a batch itself.

    Raises:
      ValueError: a leaf's leading axis is not divisible by this process's devices in ``mesh``.
    """
    check_batch(batch, len(mesh.local_devices))
    sharding = jax.sharding.NamedSharding(mesh, P(axis))
    return jax.tree_util.tree_map(lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), batch)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of ``tree`` on every device of ``mesh`` (the sharding :func:`data_parallel` gives its
    non-batch arguments), once.

    Pass the result, not the original, to the step at every call. An argument that lives on one device is
    copied to the others at each call, leaf by leaf, before the step can start: the compressed ``"sparsity"``
    pattern of a BERT-large (hundreds of small arrays) cost 17-20 ms of idle GPUs a step that way on two GPUs
    (session 36). The step's own outputs (params, optimizer state) are already replicated.
    """
    return jax.device_put(tree, NamedSharding(mesh, P()))


def check_batch(batch: Any, n_devices: int) -> None:
    """Raise a ``ValueError`` unless every leaf of ``batch`` has a leading axis divisible by ``n_devices``."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(f"batch leaf {jax.tree_util.keystr(path) or '<root>'} is a scalar: a data-parallel "
                             "batch needs a leading batch axis")
        if shape[0] % n_devices:
            raise ValueError(f"batch size {shape[0]} (leaf {jax.tree_util.keystr(path) or '<root>'}, shape {shape}) "
                             f"is not divisible by the {n_devices} devices of the mesh")


def pmean_grads(grads: Any, axis: str | None) -> Any:
    """Average a pytree (gradients, a loss, metrics) over the mesh axis ``axis``; identity when None.

    Call it inside the step given to :func:`data_parallel`, between ``jax.grad`` and ``tx.update``.
    Each leaf becomes one operand of the all-reduce, so the bytes exchanged are the bytes of the
    leaves (see :func:`exchanged_bytes`); XLA may merge the operands into one tuple all-reduce.
    """
    if axis is None:
        return grads
    with jax.named_scope("grad_allreduce"):
        return jax.lax.pmean(grads, axis)


def data_parallel(step_fn: Callable, mesh: Mesh, *, batch_argnums: Sequence[int], axis: str = DATA_AXIS,
                  donate_argnums: Sequence[int] = ()) -> Callable:
    """Jit ``step_fn`` as a data-parallel :func:`jax.shard_map` step over ``mesh``.

    Args:
      step_fn: the per-device step. It sees the local shard of the batch arguments and the full
        replicated other arguments, and must make its outputs equal on every device: average the
        gradients with :func:`pmean_grads` (``axis``) before the optimizer update, and the metrics too.
        Per-device randomness (dropout) comes from ``jax.random.fold_in(key, jax.lax.axis_index(axis))``.
        Arguments that stay the same from step to step (a ``"sparsity"`` pattern, a teacher's params, the key)
        should be placed once with :func:`replicate`: one that lives on a single device is copied to the others
        at every call.
      mesh: a 1-D mesh (:func:`local_mesh`, or :func:`global_mesh` over several processes).
      batch_argnums: positional arguments split along their leading axis (each may be a pytree). On a mesh that
        spans processes, each process passes its own rows (:func:`process_rows`), assembled by :func:`shard_batch`.
      axis: the mesh axis to split over.
      donate_argnums: passed to :func:`jax.jit`.

    Returns:
      ``fn(*args)`` with the signature of ``step_fn``; it raises a ``ValueError`` before tracing when a
      batch argument's leading axis is not divisible by the number of devices (of this process, on a mesh that
      spans processes). Outputs are replicated.

    At its second call (when the first call's params and optimizer state have come back replicated) ``fn`` warns
    about a non-batch argument that still holds more than :data:`UNPLACED_WARN_LEAVES` arrays off the mesh: the
    step copies those to every device at every call; :func:`replicate` places them once.

    Replication is not checked by JAX (``check_vma=False``): with the check on, ``jax.grad`` of a replicated
    parameter would already be summed over the axis, and an explicit ``pmean`` on top gives the wrong
    scale. Here the gradients are local until :func:`pmean_grads` averages them, as in ``pmap`` code.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    batch_argnums = tuple(batch_argnums)
    if not batch_argnums:
        raise ValueError("data_parallel needs at least one batch argument (batch_argnums)")
    n = mesh.shape[axis]
    multi = mesh.is_multi_process  # then each process passes its own rows of the batch
    jitted: dict[int, Callable] = {}

    def build(nargs: int) -> Callable:
        for i in batch_argnums:
            if not 0 <= i < nargs:
                raise ValueError(f"batch_argnums {batch_argnums} out of range for {nargs} arguments")
        in_specs = tuple(P(axis) if i in batch_argnums else P() for i in range(nargs))
        mapped = jax.shard_map(step_fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
        return jax.jit(mapped, donate_argnums=tuple(donate_argnums))

    def get(nargs: int) -> Callable:
        if nargs not in jitted:
            jitted[nargs] = build(nargs)
        return jitted[nargs]

    def prepare(args: tuple) -> list:
        args = list(args)
        for i in batch_argnums:
            if i < len(args):
                if multi:  # this process's rows -> the global batch
                    args[i] = shard_batch(args[i], mesh, axis)
                else:
                    check_batch(args[i], n)
        return args

    calls = [0]

    def warn_unplaced(args: tuple) -> None:
        """On the second call (the first one's params and optimizer state come back replicated): say which
        arguments still hold many arrays off the mesh, which the step copies to every device at every call."""
        mesh_devices = set(mesh.devices.flat)
        for i, arg in enumerate(args):
            if i in batch_argnums:
                continue
            leaves = [x for x in jax.tree_util.tree_leaves(arg)
                      if isinstance(x, jax.Array) and x.sharding.device_set != mesh_devices]
            if len(leaves) > UNPLACED_WARN_LEAVES:
                warnings.warn(f"data_parallel: argument {i} has {len(leaves)} arrays that are not on every device of the "
                              "mesh; the step copies them there at every call before it can start. Place the arguments "
                              "that stay the same from step to step once with jaxsparse.parallel.replicate(tree, mesh).",
                              stacklevel=3)

    def fn(*args):
        calls[0] += 1
        if calls[0] == 2:
            warn_unplaced(args)
        return get(len(args))(*prepare(args))

    fn.lower = lambda *args: get(len(args)).lower(*prepare(args))  # type: ignore[attr-defined]
    fn.mesh = mesh  # type: ignore[attr-defined]
    return fn


def exchanged_bytes(grads: Any) -> dict[str, Any]:
    """Bytes one device contributes to the gradient all-reduce per step, from the leaves of ``grads``.

    ``grads`` is the gradient tree (or anything shaped like it: the params tree, or
    ``jax.ShapeDtypeStruct`` leaves from :func:`jax.eval_shape`). This is the all-reduce payload (sum of
    operand sizes); a ring all-reduce moves about ``2 (n - 1) / n`` times it over each device's links.

    Returns:
      ``{"compressed": bytes of compressed sparse-layer leaves (named values), "dense": bytes of every
      other leaf, "total": their sum, "by_type": bytes per BERT layer type (:func:`jaxsparse.memory.
      layer_type`), "sparse_layers": bytes of the pruned encoder projections (kernels or values, and
      their biases), "leaves": number of leaves}``.
    """
    from jaxsparse.memory import SPARSE_TYPES, layer_type, leaf_nbytes

    out: dict[str, Any] = {"compressed": 0, "dense": 0, "by_type": {}, "leaves": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        names = pruning._path_names(path)  # noqa: SLF001 - the shared path naming of the library
        b = leaf_nbytes(leaf)
        out["compressed" if names and names[-1] == "values" else "dense"] += b
        t = layer_type(names)
        out["by_type"][t] = out["by_type"].get(t, 0) + b
        out["leaves"] += 1
    out["total"] = out["compressed"] + out["dense"]
    out["sparse_layers"] = sum(out["by_type"].get(t, 0) for t in SPARSE_TYPES)
    return out


def bert_exchanged_bytes(model: str = "base", sparsity: str = "64:2:8") -> dict[str, dict]:
    """:func:`exchanged_bytes` of a BERT preset's gradients in master mode and in compressed mode.

    Shapes only (:func:`jax.eval_shape` of the model init: gradients have the shapes and dtypes of the
    float32 params), so BERT-large costs nothing. Returns ``{"master": ..., "compressed": ...}``.
    """
    from jaxsparse.models import bert

    cfg = bert.BertConfig.preset(model)
    ids = jnp.ones((1, 8), jnp.int32)

    def shapes(compressed: bool):
        m = bert.BertForSequenceClassification(cfg, sparsity=sparsity, compressed=compressed)
        return jax.eval_shape(lambda k: m.init(k, ids)["params"], jax.random.key(0))

    return {"master": exchanged_bytes(shapes(False)), "compressed": exchanged_bytes(shapes(True))}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxsparse.parallel --model base --sparsity 64:2:8``: the gradient all-reduce payload."""
    p = argparse.ArgumentParser(prog="python -m jaxsparse.parallel", description=main.__doc__)
    p.add_argument("--model", default="base")
    p.add_argument("--sparsity", default="64:2:8")
    a = p.parse_args(argv)
    rep = bert_exchanged_bytes(a.model, a.sparsity)
    mb = lambda b: f"{b / 2**20:9.2f} MiB"  # noqa: E731
    m, c = rep["master"], rep["compressed"]
    print(f"{a.model} {a.sparsity}: gradient all-reduce payload per device per step (float32)")
    print(f"  sparse layers: master {mb(m['sparse_layers'])}  compressed {mb(c['sparse_layers'])}  "
          f"({c['sparse_layers'] / m['sparse_layers']:.1%})")
    print(f"  whole model:   master {mb(m['total'])}  compressed {mb(c['total'])}  ({c['total'] / m['total']:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
