"""SIGTERM or SIGINT to `python -m deploy.cli serve` (a local Ray cluster): the stream in flight
ends, the process exits 0, and every process it started (GCS, raylet, agents, every actor, the
TP rank actor) is gone."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from deploy.ray_node import REPO_ROOT, descendant_pids, process_is_running
from tests.deploy.ray_support import StreamResult, stream, tiny_model_with_tokenizer

CONFIG = """\
model: {model_dir}
dtype: float64
prefill:
  instances: 1
  tensor_parallel_size: 2
decode:
  instances: 1
kv_cache:
  block_size: 8
  num_blocks: 128
router:
  host: 127.0.0.1
  port: 0
  metrics_port: null
"""


def _read_lines(pipe: object, lines: queue.Queue[str]) -> None:
    for line in pipe:  # type: ignore[attr-defined]
        lines.put(line)


def _wait_for_address(lines: queue.Queue[str], seen: list[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if "serving on " in line:
            return line.split("serving on ", 1)[1].split()[0].rstrip(";,")
    pytest.fail("serve did not report its address:\n" + "".join(seen[-40:]))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_serve_drains_and_leaves_no_process(tmp_path: Path, signum: int) -> None:
    model_dir = tiny_model_with_tokenizer(tmp_path)
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG.format(model_dir=model_dir))
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'proto'}"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--config", str(config)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(serve.stdout, lines), daemon=True).start()
    seen: list[str] = []
    pids: list[int] = []
    try:
        address = _wait_for_address(lines, seen, 150)
        started: list[int] = []
        results: list[StreamResult] = []
        streamer = threading.Thread(
            target=lambda: results.append(stream(address, [1, 7, 9, 30, 41], 400, 60, started))
        )
        streamer.start()
        deadline = time.monotonic() + 30
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = descendant_pids(serve.pid)
        assert len(pids) >= 8, pids  # gcs, raylet, agents, monitor, router, workers, rank
        serve.send_signal(signum)
        assert serve.wait(60) == 0, "".join(seen[-40:])
        streamer.join(30)
        # the stream either finished in the drain or was ended by the shutdown
        assert results[0].code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE,
                                   grpc.StatusCode.CANCELLED), results[0]  # fmt: skip
        if results[0].code == grpc.StatusCode.OK:
            assert len(results[0].token_ids) == 400
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)
    deadline = time.monotonic() + 10
    while any(process_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if process_is_running(pid)] == []
