"""The two documented loops in examples/ run end to end and learn (shortened schedules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax.linen's dataclass modules look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["gmp_loop", "gmp_loop_nnx"])
def test_example_loop_prunes_compresses_and_learns(name, capsys):
    """Each stage's masks obey their pattern ("mask ok True" at every printed step, none False), the compressed
    model trains on and classifies the synthetic task well above chance (4 classes)."""
    result = _load(name).main(steps=150, begin=10, end=80)
    out = capsys.readouterr().out
    assert "mask ok False" not in out and out.count("mask ok True") >= 4, out
    assert "stage 32:2:16 sparsity 0.875" in out, out
    assert np.isfinite(result["loss"]) and result["accuracy"] > 0.6, result
