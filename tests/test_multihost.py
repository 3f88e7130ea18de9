"""Data-parallel training over several processes (``jaxsparse.parallel.global_mesh``), on the CPU.

Two processes with two host devices each, joined by ``jax.distributed`` (gloo collectives on the CPU), run the
``data_parallel`` step of a model of compressed ``NMDense`` layers, each passing only its own rows of every batch
(``process_rows``). The parameters after a few steps must match the single-device step on the whole batch, and be
the same in both processes; then the same processes run ``jaxsparse-train``'s training loop over both. The
processes run this file as a script; each prints one JSON report.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BATCH, STEPS = 16, 3


# --------------------------------------------------------------------------------------------- worker
def _worker(process_id: int, processes: int, port: int, out: str) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process_id)
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    from jaxsparse import parallel
    from jaxsparse.nn import NMDense

    jax.config.update("jax_default_matmul_precision", "highest")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(NMDense(32, sparsity="16:2:8", compressed=True, dtype=jnp.float32)(x))
            return NMDense(16, sparsity="2:4", compressed=True, dtype=jnp.float32)(h)

    net = Net()
    rng = np.random.default_rng(0)  # the same global batch and parameters in every process
    x = rng.normal(size=(BATCH, 64)).astype(np.float32)
    y = rng.normal(size=(BATCH, 16)).astype(np.float32)
    variables = net.init(jax.random.key(0), x[:1])
    params0, pattern = variables["params"], variables["sparsity"]
    tx = optax.sgd(0.05, momentum=0.9)  # scale-sensitive: a wrong gradient average changes the update

    def step(params, opt_state, batch, axis=None):
        def loss_fn(p):
            out = net.apply({"params": p, "sparsity": pattern}, batch[0])
            return jnp.mean(jnp.square(out - batch[1]))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads, loss = parallel.pmean_grads((grads, loss), axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mesh = parallel.global_mesh()
    dp = parallel.data_parallel(functools.partial(step, axis=parallel.DATA_AXIS), mesh, batch_argnums=(2,))
    rows = parallel.process_rows(BATCH, mesh)
    params, state, dp_losses = params0, tx.init(params0), []
    for _ in range(STEPS):
        params, state, loss = dp(params, state, (x[rows], y[rows]))
        dp_losses.append(float(loss))
    dp_params = jax.tree_util.tree_map(np.asarray, params)  # replicated: this process's copy

    single = jax.jit(step)
    ref, state, single_losses = params0, tx.init(params0), []
    for _ in range(STEPS):
        ref, state, loss = single(ref, state, (x, y))
        single_losses.append(float(loss))

    leaves = lambda t: [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(t)]  # noqa: E731
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves(dp_params), leaves(ref)))
    upd = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves(ref), leaves(params0)))
    errors = {}
    for name, call in (("rows", lambda: parallel.process_rows(BATCH - 2, mesh)),
                       ("shard", lambda: parallel.shard_batch(x[:3], mesh))):
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    # the CLI's training loop on the same processes (jax.distributed is up: --devices all spans both)
    from jaxsparse import train

    cli = train.run(train.parse_args(["--model", "tiny", "--task", "trec", "--max-train", "256", "--max-eval", "32",
                                      "--max-len", "16", "--batch-size", "32", "--lr", "2e-3", "--warmup", "0",
                                      "--no-progress", "--sparsity", "16:2:8", "--compress", "on", "--devices", "all",
                                      "--out", out]))
    return {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
            "cli": {k: cli[k] for k in ("devices", "processes", "history", "test_accuracy", "compressed_training")},
            "local_devices": jax.local_device_count(), "mesh": mesh.size, "rows": [rows.start, rows.stop],
            "max_rel": err / upd, "dp_losses": dp_losses, "single_losses": single_losses,
            "param_sum": float(sum(np.sum(np.abs(a)) for a in leaves(dp_params))),
            "value_shapes": [list(a.shape) for a in jax.tree_util.tree_leaves(dp_params)], "errors": errors}


# --------------------------------------------------------------------------------------------- tests
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multihost_run")


@pytest.fixture(scope="module")
def reports(out_dir) -> list[dict]:
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=path)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(i), "2", str(port), str(out_dir)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, stderr[-4000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_two_processes_make_one_mesh(reports):
    for i, r in enumerate(reports):
        assert (r["process"], r["processes"], r["devices"], r["local_devices"], r["mesh"]) == (i, 2, 4, 2, 4)
    assert [r["rows"] for r in reports] == [[0, BATCH // 2], [BATCH // 2, BATCH]]


def test_each_process_feeding_its_rows_matches_the_whole_batch_step(reports):
    for r in reports:
        assert r["max_rel"] < 1e-4, r
        np.testing.assert_allclose(r["dp_losses"], r["single_losses"], rtol=1e-5)
        assert r["dp_losses"][-1] < r["dp_losses"][0]
        # compressed layers: the gradients exchanged are the values, [R, 2K/M], not dense [K, R] kernels
        assert [32, 16] in r["value_shapes"] and [16, 16] in r["value_shapes"]


def test_replicas_agree_across_processes(reports):
    assert reports[0]["param_sum"] == reports[1]["param_sum"]


def test_uneven_batches_are_clear_errors(reports):
    errors = reports[0]["errors"]
    assert "not divisible by the 4 devices" in errors["rows"]
    assert "not divisible by the 2 devices" in errors["shard"]


def test_the_training_cli_runs_across_processes(reports, out_dir):
    """``jaxsparse-train --devices all`` on two processes: one data-parallel run over their four devices, the same
    steps in both (replicated), the outputs written once, by process 0."""
    a, b = reports[0]["cli"], reports[1]["cli"]
    assert (a["devices"], a["processes"]) == (4, 2) and a["compressed_training"]
    assert a["history"][0]["train_loss"] == b["history"][0]["train_loss"] and a["test_accuracy"] == b["test_accuracy"]
    assert a["history"][-1]["train_loss"] < a["history"][0]["first_loss"]
    written = json.loads((out_dir / "metrics.json").read_text())
    assert (written["processes"], written["devices"]) == (2, 4)
    from jaxsparse import train

    layer = train.load_checkpoint(out_dir / "checkpoint")["params"]["bert"]["encoder_layer_0"]["intermediate"]
    assert "values" in layer and "kernel" not in layer


def test_cli_distributed_options_go_together():
    from jaxsparse import train

    for bad in (["--coordinator", "h:1"], ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"],
                ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2", "--devices", "all"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    args = train.parse_args(["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1", "--devices", "all"])
    assert (args.coordinator, args.num_processes, args.process_id, args.devices) == ("h:1", 2, 1, "all")


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
