"""The goodput plots can be drawn again from a committed summary alone."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.goodput.replot import main

SUMMARY = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "goodput-2core.json"


def test_replot_draws_every_regime_of_the_committed_summary(tmp_path, capsys):
    assert main([str(SUMMARY), "--out", str(tmp_path)]) == 0
    written = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plots"]
    regimes = json.loads(SUMMARY.read_text())["regimes"]
    assert len(written) == 2 * len(regimes)
    for path in written:
        assert Path(path).parent == tmp_path
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
