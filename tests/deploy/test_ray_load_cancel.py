"""benchmarks/load_cancel.py at a scale CI affords, on a local Ray cluster started by
`pdserve serve`: streams at once past the router's limits, long streams half cancelled, short
requests with cancels. Every refused call is RESOURCE_EXHAUSTED (Ray admits by the same limits
as plain processes), nothing else fails, health tells the truth, every KV pool is back at its
count within a second, and serve stops on SIGTERM to its group leaving no process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.load_cancel import main
from tests.deploy.ray_support import tiny_model_with_tokenizer

pytestmark = pytest.mark.slow  # a Ray cluster under load

# Small limits: the 45-stream phase must overflow 8 running + 8 queued.
LIMITS = "router: {max_running_requests: 8, max_queued_requests: 8}\nkv_cache: {num_blocks: 256}\n"


def test_load_with_cancels_on_ray_keeps_serving(tmp_path: Path) -> None:
    model_dir = tiny_model_with_tokenizer(tmp_path)
    (tmp_path / "limits.yaml").write_text(LIMITS)
    out = tmp_path / "result.json"
    code = main(
        [
            "--scale",
            "0.03",
            "--model",
            model_dir,
            "--config",
            str(tmp_path / "limits.yaml"),
            "--out",
            str(out),
            "--time-limit-s",
            "120",
            "--request-timeout-s",
            "60",
        ]
    )
    result = json.loads(out.read_text())
    phases = {phase["name"]: phase["codes"] for phase in result["phases"]}
    assert result["complete"], result
    assert result["errors"] == {}, result
    assert phases["concurrent-1500"].get("RESOURCE_EXHAUSTED", 0) > 0, phases
    assert phases["short-10pct-cancelled"].get("OK", 0) > 0, phases
    assert result["health"]["num_lies"] == 0, result["health"]
    assert result["pools"]["returned"], result["pools"]
    assert result["shutdown"]["exit_code"] == 0 and result["shutdown"]["processes_left"] == []
    assert code == 0
