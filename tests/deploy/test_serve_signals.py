"""SIGTERM or SIGINT to `python -m deploy.cli.main serve`, sent to the whole process group (what
systemd and a terminal's Ctrl-C do), on a local Ray cluster and as plain processes: the stream in
flight finishes within the drain, the process exits 0, and every process it started (Ray: GCS,
raylet, agents, every actor, the TP rank actor, and Ray's temp dir; plain: every worker process
and TP rank, which ignore the group's signal and obey their parent) is gone; the same for the
colocated and adaptive modes under both runtimes. A second signal ends the drain at once."""

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

from deploy.runtime.ray.node import REPO_ROOT, descendant_pids, process_is_running
from tests.deploy.ray_support import StreamResult, stream, tiny_model_with_tokenizer

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

# What both layouts share: a small KV pool and a router on loopback with a free port.
_COMMON = """\
kv_cache:
  block_size: 8
  num_blocks: 128
router:
  host: 127.0.0.1
  port: 0
  metrics_port: null
"""
CONFIG = (
    """\
model: {model_dir}
dtype: float64
prefill:
  instances: 1
  tensor_parallel_size: 2
decode:
  instances: 1
"""
    + _COMMON
)
# Mode adaptive: two instances that each prefill and decode.
ADAPTIVE_CONFIG = (
    """\
model: {model_dir}
dtype: float64
mode: adaptive
adaptive:
  instances: 2
"""
    + _COMMON
    + "  latency_profile: {profile}\n"
)
# Mode colocated: two replicas, each running requests start to end.
COLOCATED_CONFIG = (
    """\
model: {model_dir}
dtype: float64
mode: colocated
colocated:
  instances: 2
"""
    + _COMMON
)
LAYOUTS = {"colocated": COLOCATED_CONFIG, "adaptive": ADAPTIVE_CONFIG}
PROFILE = REPO_ROOT / "tests/data/profile-2core.json"
_PROMPT = [1, 7, 9, 30, 41]
_MAX_TOKENS = 480


class Serve:
    """`deploy.cli.main serve` in its own session (its pid is its process group), output collected."""

    def __init__(self, tmp_path: Path, ray: bool = True, template: str = CONFIG) -> None:
        model_dir = tiny_model_with_tokenizer(tmp_path)
        config = tmp_path / "serve.yaml"
        config.write_text(template.format(model_dir=model_dir, profile=PROFILE))
        serve = [sys.executable, "-m", "deploy.cli.main", "serve", "--config", str(config)]
        self._spawn([*serve, *([] if ray else ["--no-ray"])])

    @classmethod
    def command(cls, argv: list[str]) -> Serve:
        """Any command line (`pdserve serve --config ...`), watched the same way."""
        serve = cls.__new__(cls)
        serve._spawn(argv)
        return serve

    def _spawn(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'proto'}"}
        self.process = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.lines.put(line)

    def wait_for(self, marker: str, timeout_s: float) -> str:
        """The rest of the first output line holding `marker`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            self.seen.append(line)
            if marker in line:
                return line.split(marker, 1)[1].strip()
        pytest.fail(f"serve did not print {marker!r}:\n" + self.output())

    def output(self) -> str:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen[-60:])

    def signal_group(self, signum: int) -> None:
        os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def _start_stream(address: str) -> tuple[threading.Thread, list[StreamResult]]:
    started: list[int] = []
    results: list[StreamResult] = []
    streamer = threading.Thread(
        target=lambda: results.append(stream(address, _PROMPT, _MAX_TOKENS, 120, started))
    )
    streamer.start()
    deadline = time.monotonic() + 30
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started, "the stream did not start"
    return streamer, results


def _assert_nothing_left(pids: list[int], temp_dir: str | None) -> None:
    deadline = time.monotonic() + 10
    while any(process_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if process_is_running(pid)] == []
    if temp_dir is not None:
        assert not Path(temp_dir).exists(), f"Ray's temp dir {temp_dir} was left behind"


@pytest.mark.parametrize("ray", [True, False], ids=["ray", "plain"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_group_drains_and_leaves_no_process(
    tmp_path: Path, signum: int, ray: bool
) -> None:
    serve = Serve(tmp_path, ray)
    pids: list[int] = []
    temp_dir: str | None = None
    try:
        if ray:
            temp_dir = serve.wait_for("Ray temp dir ", 150)
        address = serve.wait_for("serving on ", 150).split()[0].rstrip(";,")
        streamer, results = _start_stream(address)
        pids = descendant_pids(serve.process.pid)
        # Ray: gcs, raylet, agents, monitor, workers, rank; plain: 2 workers and a TP rank
        assert len(pids) >= (8 if ray else 3), pids
        began = time.monotonic()
        serve.signal_group(signum)
        assert serve.process.wait(60) == 0, serve.output()
        streamer.join(30)
        # the drain let the stream finish: every token, status OK
        assert results[0].code == grpc.StatusCode.OK, (results[0], serve.output())
        assert len(results[0].token_ids) == _MAX_TOKENS
        assert time.monotonic() - began < 45
        assert "Traceback" not in serve.output()
        assert "Task was destroyed" not in serve.output()  # the router loop closed under a task
    finally:
        serve.kill()
    _assert_nothing_left(pids, temp_dir)


# Each layout in each runtime, each signal in each runtime and layout once: both signals take
# one handler, which the disaggregated test above runs with both in both runtimes.
@pytest.mark.parametrize(
    "signum,mode,ray",
    [
        pytest.param(signal.SIGTERM, "colocated", True, id="SIGTERM-colocated-ray"),
        pytest.param(signal.SIGINT, "colocated", False, id="SIGINT-colocated-plain"),
        pytest.param(signal.SIGINT, "adaptive", True, id="SIGINT-adaptive-ray"),
        pytest.param(signal.SIGTERM, "adaptive", False, id="SIGTERM-adaptive-plain"),
    ],
)
def test_colocated_and_adaptive_drain_on_a_signal_to_the_group(
    tmp_path: Path, signum: int, mode: str, ray: bool
) -> None:
    """The same drain, exit 0, and both instances (Ray: and all of Ray) gone."""
    serve = Serve(tmp_path, ray=ray, template=LAYOUTS[mode])
    pids: list[int] = []
    temp_dir: str | None = None
    try:
        if ray:
            temp_dir = serve.wait_for("Ray temp dir ", 150)
        address = serve.wait_for("serving on ", 150).split()[0].rstrip(";,")
        streamer, results = _start_stream(address)
        pids = descendant_pids(serve.process.pid)
        assert len(pids) >= (8 if ray else 2), pids  # at least the two instances
        serve.signal_group(signum)
        assert serve.process.wait(60) == 0, serve.output()
        streamer.join(30)
        assert results[0].code == grpc.StatusCode.OK, (results[0], serve.output())
        assert len(results[0].token_ids) == _MAX_TOKENS
        assert "Traceback" not in serve.output()
        assert "Task was destroyed" not in serve.output()  # the router loop closed under a task
    finally:
        serve.kill()
    _assert_nothing_left(pids, temp_dir)


def test_second_signal_ends_the_drain_at_once(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    pids: list[int] = []
    try:
        temp_dir = serve.wait_for("Ray temp dir ", 150)
        address = serve.wait_for("serving on ", 150).split()[0].rstrip(";,")
        streamer, _results = _start_stream(address)
        pids = descendant_pids(serve.process.pid)
        serve.signal_group(signal.SIGTERM)
        serve.wait_for("draining", 10)
        began = time.monotonic()
        serve.signal_group(signal.SIGTERM)
        serve.process.wait(15)
        assert time.monotonic() - began < 10, serve.output()
        streamer.join(30)
    finally:
        serve.kill()
    _assert_nothing_left(pids, temp_dir)
