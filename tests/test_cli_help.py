"""Every command line's ``--help`` can be printed.

argparse formats each help string with ``%`` (``%(default)s``), so a bare ``%`` in one (``V % 64``) makes
``--help`` raise ``ValueError`` instead of printing. Read statically from the source of every package module,
benchmark and script: no script is imported or run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("jaxsparse/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py"),
                  *ROOT.glob("examples/*.py")])
_BARE_PERCENT = re.compile(r"%(?!\(\w+\)[sdrfg])")


def _bare_percent(text: str) -> bool:
    """A ``%`` that is neither ``%%`` nor a ``%(name)s`` field."""
    return bool(_BARE_PERCENT.search(text.replace("%%", "")))


def _help_strings(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for kw in node.keywords:
                if kw.arg == "help":  # (a description is %-formatted only where it holds "%(prog)")
                    try:
                        text = ast.literal_eval(kw.value)
                    except ValueError:  # built at run time (an f-string, a call): not checked here
                        continue
                    if isinstance(text, str):
                        yield node.lineno, text


def test_sources_are_found():
    names = {p.name for p in SOURCES}
    assert {"train.py", "profile.py", "train_step.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_help_strings_have_no_bare_percent(path):
    bad = [f"line {line}: {text!r}" for line, text in _help_strings(path) if _bare_percent(text)]
    assert not bad, f"{path.name}: write a literal % as %% in argparse help: " + "; ".join(bad)


def test_the_check_catches_a_bare_percent(tmp_path):
    script = tmp_path / "s.py"
    script.write_text('import argparse\np = argparse.ArgumentParser()\n'
                      'p.add_argument("--a", help="V % 64 == 0")\np.add_argument("--b", help="100%% (%(default)s)")\n')
    found = [text for _, text in _help_strings(script) if _bare_percent(text)]
    assert found == ["V % 64 == 0"]
