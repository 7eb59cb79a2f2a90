"""Every notebook runs top to bottom (they are jupytext percent scripts)."""

import runpy
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    if path.stem == "kv_policies":  # the paged step must reproduce dense attention
        err = float(out.split("max |paged - dense| =")[1].split()[0])
        assert err < 1e-4, out
