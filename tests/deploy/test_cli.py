"""The `pdserve` command line end to end: `serve --no-ray` as a real subprocess (1 prefill at TP=2,
2 decodes, a tiny model), `generate` and `status` against it, SIGTERM leaving no process, auth
through a token file, and `demo` as a subprocess that prints its table and leaves nothing."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.cli.main import main
from deploy.runtime.handle import LocalHandle
from engine.config import EngineConfig
from router.config import RouterConfig
from tests.router.harness import RouterThread
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Role

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 150.0
PROMPT = "The quick brown fox"
NUM_KV_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("cli_model"), "llama"))


def _env(marker: str) -> dict[str, str]:
    """The child's environment; the marker lets the test find every process it left behind."""
    path = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "proto")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PDSERVE_TEST_RUN": marker}


def processes_with_marker(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment carries the marker."""
    needle = f"PDSERVE_TEST_RUN={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(name))
    return found


@dataclass
class Child:
    """A `pdserve` subprocess whose output lines arrive on a queue (reads never block)."""

    process: subprocess.Popen[str]
    marker: str
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, *args: str) -> Child:
        marker = uuid.uuid4().hex
        process = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli.main", *args],
            cwd=REPO_ROOT,
            env=_env(marker),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        child = cls(process, marker)
        threading.Thread(target=child._read, daemon=True).start()
        return child

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines))

    def finish(self, timeout_s: float) -> int:
        code = self.process.wait(timeout_s)
        while (line := self._queue.get(timeout=5)) is not None:
            self.lines.append(line)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        for pid in processes_with_marker(self.marker):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Served:
    child: Child
    address: str
    metrics: str


@pytest.fixture(scope="module")
def served(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config_file = tmp_path_factory.mktemp("serve") / "serve.yaml"
    config_file.write_text(f"kv_cache: {{num_blocks: {NUM_KV_BLOCKS}}}\nrouter: {{port: 1}}\n")
    child = Child.start(
        "serve",
        "--config",
        str(config_file),
        "--no-ray",
        "--model",
        model_dir,
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--prefill-instances",
        "1",
        "--prefill-tp",
        "2",
        "--decode-instances",
        "2",
    )
    try:
        match = child.wait_for_line(
            r"serving on (\S+), metrics http://(\S+)/metrics", START_TIMEOUT_S
        )
        yield Served(child, match.group(1), match.group(2))
    finally:
        child.kill()


def _unary(address: str, request: pb.GenerateRequest) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.GenerationStub(channel).GenerateUnary(request, timeout=60)


def test_serve_reports_progress_while_starting(served: Served) -> None:
    output = "\n".join(served.child.lines)
    for instance in ("prefill-0 (TP=2)", "decode-0 (TP=1)", "decode-1 (TP=1)"):
        assert f"starting {instance}: loading" in output
    assert re.search(r"prefill-0 ready \(\d+\.\d s\)", output)


def test_generate_streams_the_same_text_as_a_unary_call(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--address",
        served.address,
        "--prompt",
        PROMPT,
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]
    assert main(argv) == 0
    streamed = capsys.readouterr()
    unary = _unary(
        served.address, pb.GenerateRequest(prompt=PROMPT, max_tokens=12, ignore_eos=True)
    )
    assert len(unary.token_ids) == 12
    assert streamed.out == unary.text + "\n"
    assert streamed.err.startswith("[length: 12 tokens, TTFT ")


def test_generate_passes_sampling_flags_and_stop_strings(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    sampled = [
        "generate",
        "--address",
        served.address,
        "--prompt",
        PROMPT,
        "--max-tokens",
        "10",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--seed",
        "7",
    ]
    assert main(sampled) == 0 and main(sampled) == 0
    first, second = capsys.readouterr().out.split("\n")[:2]
    request = pb.GenerateRequest(
        prompt=PROMPT, max_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=50, seed=7
    )
    assert first == second == _unary(served.address, request).text  # seeded: reproducible
    full = _unary(served.address, pb.GenerateRequest(prompt=PROMPT, max_tokens=16, ignore_eos=True))
    stop = full.text[len(full.text) // 2 :][:3]
    cut = full.text[: full.text.index(stop)]
    argv = [
        "generate",
        "--address",
        served.address,
        "--prompt",
        PROMPT,
        "--max-tokens",
        "16",
        "--ignore-eos",
        "--stop",
        stop,
    ]
    assert main(argv) == 0
    result = capsys.readouterr()
    assert result.out == cut + "\n" and result.err.startswith("[stop: ")


def test_generate_takes_a_json_schema_file(
    served: Served, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    argv = ["generate", "--address", served.address, "--prompt", PROMPT, "--max-tokens", "80"]
    assert main([*argv, "--json-schema", str(path)]) == 0
    result = capsys.readouterr()
    assert json.loads(result.out)["n"] in (1, 2, 3) and result.err.startswith("[stop: ")
    assert main([*argv, "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out in ("yes\n", "no\n")
    assert main([*argv, "--json-schema", str(tmp_path / "missing.json")]) != 0


def test_generate_reports_a_rejected_request_and_exits_1(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--address", served.address, "--prompt", PROMPT, "--top-p", "1.5"]
    assert main(argv) == 1
    assert capsys.readouterr().err.startswith("pdserve generate: INVALID_ARGUMENT: ")


def _status_lines(served: Served, capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(["status", "--address", served.address, "--metrics", served.metrics]) == 0
    return capsys.readouterr().out.splitlines()


def test_status_shows_every_worker_its_load_kv_usage_and_health(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    # The last request's aborts and the router's next load refresh land within a moment.
    deadline = time.monotonic() + 10
    while " 0 running" not in (lines := _status_lines(served, capsys))[5] or any(
        line.split()[4:6] != ["0", "0"] for line in lines[2:5]
    ):
        assert time.monotonic() < deadline, "\n".join(lines)
        time.sleep(0.2)
    assert lines[0] == f"router {served.address}: SERVING"
    assert lines[1].split() == [
        "instance",
        "role",
        "node",
        "health",
        "waiting",
        "running",
        "KV",
        "blocks",
        "KV",
        "used",
    ]
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    assert sorted(rows) == ["decode-0", "decode-1", "prefill-0"]
    for instance_id, row in rows.items():
        role = instance_id.split("-")[0]
        assert row[1:6] == [role, socket.gethostname(), "healthy", "0", "0"], row
        used, total = map(int, row[6].split("/"))
        assert total == NUM_KV_BLOCKS and row[7] == f"{100 * used / total:.0f}%"
        assert used == 0 or role == "prefill"  # prefill keeps prompts in its prefix cache
    assert re.fullmatch(r"requests: 0 running, 0 queued, \d+ finished \(.*\), 1 failed", lines[5])
    # Both decode instances have taken a hand-off from both prefill TP ranks on this one host.
    assert lines[6].split() == ["KV", "link", "(prefill>decode", "rank)", "transport"]
    pairs = [f"prefill-0.{rank}>decode-{d}.0" for rank in (0, 1) for d in (0, 1)]
    assert dict(line.split() for line in lines[7:]) == dict.fromkeys(pairs, "shared-memory")


def test_status_of_an_unreachable_router_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--address", "127.0.0.1:1", "--metrics", "127.0.0.1:1"]) == 2
    assert "pdserve status: error:" in capsys.readouterr().err


def test_sigterm_drains_and_leaves_no_process(served: Served) -> None:
    child = served.child
    assert len(processes_with_marker(child.marker)) >= 5  # serve, prefill + rank, 2 decodes
    child.process.send_signal(signal.SIGTERM)
    assert child.finish(timeout_s=60) == 0
    own_lines = [line for line in child.lines if line.startswith("[pdserve]")]
    assert own_lines[-2][: len("[pdserve] stopping: draining")] == "[pdserve] stopping: draining"
    assert own_lines[-1] == "[pdserve] stopped"
    deadline = time.monotonic() + 10
    while processes_with_marker(child.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(child.marker) == []


def test_generate_sends_the_bearer_token_from_a_file(
    model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "token").write_text("open-sesame\n")
    config = RouterConfig(model_dir=model_dir, auth_token="open-sesame")
    engine = EngineConfig(model_dir=model_dir, num_kv_blocks=32, num_threads=1)

    def make_handles() -> tuple[list[LocalHandle], list[LocalHandle]]:
        worker = Worker(WorkerConfig(engine), "colocated-0")
        return [LocalHandle("colocated-0", Role.COLOCATED, worker)], []

    with RouterThread(config, make_handles) as server:
        argv = ["generate", "--address", server.address, "--prompt", PROMPT, "--max-tokens", "4"]
        assert main([*argv, "--token", str(tmp_path / "token")]) == 0
        assert capsys.readouterr().err.startswith("[")
        assert main([*argv, "--auth-token", "wrong"]) == 1
        assert capsys.readouterr().err.startswith("pdserve generate: UNAUTHENTICATED: ")


def test_demo_streams_prints_the_table_and_leaves_no_process(model_dir: str) -> None:
    child = Child.start("demo", "--no-ray", "--model", model_dir, "--max-tokens", "6")
    try:
        assert child.finish(timeout_s=START_TIMEOUT_S) == 0, "\n".join(child.lines)
    finally:
        child.kill()
    lines = child.lines
    header = next(i for i, line in enumerate(lines) if line.startswith("request  prompt tok"))
    rows = [line.split() for line in lines[header + 1 :] if line.startswith("demo-")]
    assert [row[0] for row in rows] == [f"demo-{i}" for i in range(6)]
    for row in rows:
        assert row[2] == "6" or int(row[2]) < 6  # greedy may hit EOS early
        assert all(float(value) > 0 for value in row[3:6]), row  # TTFT, TPOT, KV transfer
        assert row[6] == "prefill-0" and row[7] == "->" and row[8] in ("decode-0", "decode-1")
    assert {row[8] for row in rows} == {"decode-0", "decode-1"}  # both decodes served
    assert "[pdserve] shutting down" in lines
    assert processes_with_marker(child.marker) == []
