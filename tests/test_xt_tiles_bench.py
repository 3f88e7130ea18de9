"""benchmarks/xt_tiles.py refuses a tile or an epilogue mode it does not know, naming the choices, before it looks
for a GPU."""

from __future__ import annotations

import pytest
from devdata_helpers import load_script


@pytest.mark.parametrize("option, value, choice", [("--tiles", "auto,p128x128", "ws128x256"),
                                                   ("--modes", "plain,act 3", "act 2")])
def test_unknown_tile_or_mode_is_refused(option, value, choice, capsys):
    bench = load_script("xt_tiles", "benchmarks")
    with pytest.raises(SystemExit) as exc:
        bench.main([option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert value.split(",")[1] in err and choice in err
