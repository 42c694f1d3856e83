"""The cold-start benchmark splits launch-to-SERVING by the start-up lines of both runtimes, and
the CLI's "ready in" counts from the process's launch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.cold_start import stages


def test_ray_lines_split_into_their_stages() -> None:
    lines = [
        (2.6, "[pdserve] starting Ray"),
        (5.0, "[pdserve] Ray temp dir /tmp/x"),
        (5.0, "[pdserve] reserving 4 workers"),
        (5.1, "[pdserve] loading the model on every worker"),
        (12.5, "[pdserve] forming the KV channels"),
        (12.6, "[pdserve] starting the router"),
        (13.6, "[pdserve] waiting for the router's health SERVING"),
    ]
    spent = stages(lines, serving_s=13.7)
    assert list(spent) == [
        "imports",
        "ray_start",
        "reserve_workers",
        "workers",
        "kv_channels",
        "router",
        "health",
    ]
    assert spent["imports"] == 2.6 and spent["ray_start"] == 2.4 and spent["workers"] == 7.4
    assert sum(spent.values()) == pytest.approx(13.7)


def test_plain_process_lines_count_each_worker_once() -> None:
    lines = [
        (2.3, "[pdserve] starting prefill-0 (TP=2): loading /m"),
        (2.3, "[pdserve] starting decode-0 (TP=1): loading /m"),
        (6.8, "[pdserve] decode-0 ready (4.4 s)"),
        (9.9, "[pdserve] prefill-0 ready (7.6 s)"),
        (9.9, "[pdserve] starting the router"),
        (10.8, "[pdserve] waiting for the router's health SERVING"),
    ]
    spent = stages(lines, serving_s=10.9)
    assert spent == pytest.approx({"imports": 2.3, "workers": 7.6, "router": 0.9, "health": 0.1})


def test_seconds_since_launch_counts_the_imports() -> None:
    code = (
        "import time; time.sleep(0.5); "
        "from deploy.runtime.router_host import seconds_since_launch; print(seconds_since_launch())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 0.5 <= float(done.stdout) < 60
