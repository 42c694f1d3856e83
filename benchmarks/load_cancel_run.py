"""The parts of benchmarks/load_cancel.py: the served cluster, the phases, the health monitor.

A request's outcome is its gRPC status code name, or CANCELLED_BY_CLIENT when this script
cancelled it on purpose (a CANCELLED the client did not ask for stays CANCELLED: an error).
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.cli.client import parse_metrics
from deploy.runtime.ray.node import REPO_ROOT, descendant_pids, process_is_running

_STREAMS_PER_CHANNEL = 100  # many connections, as from many clients
_OVERLOAD = ("RESOURCE_EXHAUSTED",)


@dataclass(frozen=True)
class Phase:
    name: str
    num_requests: int
    max_tokens: int
    prompt_len: int
    max_in_flight: int | None = None  # None: all at once
    cancel_fraction: float = 0.0
    cancel_within_s: float = 0.0

    def scaled(self, scale: float) -> Phase:
        in_flight = self.max_in_flight and max(4, round(self.max_in_flight * scale))
        return replace(
            self, num_requests=max(2, round(self.num_requests * scale)), max_in_flight=in_flight
        )


PHASES = (
    Phase("concurrent-600", 600, max_tokens=32, prompt_len=24),
    Phase("concurrent-1500", 1500, max_tokens=32, prompt_len=24),
    Phase(
        "long-half-cancelled",
        200,
        max_tokens=400,
        prompt_len=64,
        cancel_fraction=0.5,
        cancel_within_s=3.0,
    ),
    Phase(
        "short-10pct-cancelled",
        2000,
        max_tokens=8,
        prompt_len=16,
        max_in_flight=200,
        cancel_fraction=0.1,
        cancel_within_s=0.5,
    ),
)


@dataclass
class PhaseResult:
    name: str
    num_requests: int
    codes: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)  # a few details per error
    seconds: float = 0.0
    timed_out: bool = False

    def summary(self) -> str:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(self.codes.items()))
        return f"{self.name}: {self.num_requests} requests in {self.seconds:.1f} s: {codes}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Server:
    """`python -m deploy.cli.main serve` in a session of its own; its address and metrics URL."""

    def __init__(self, process: subprocess.Popen[str], address: str, metrics: str) -> None:
        self.process = process
        self.address = address
        self.metrics_url = f"http://{metrics}/metrics"
        self.vocab_size = 256  # random prompts take token ids in [3, vocab_size)
        self._channels: list[grpc.aio.Channel] = []
        self.ray_temp_dir: str | None = None

    @classmethod
    def start(cls, config: Path, start_timeout_s: float) -> Server:
        env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'proto'}"}
        process = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli.main", "serve", "--config", str(config)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_echo, args=(process, lines), daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        temp_dir = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            ray_dir = re.search(r"Ray temp dir (\S+)", line)
            temp_dir = ray_dir.group(1) if ray_dir else temp_dir
            match = re.search(r"serving on (\S+), metrics http://(\S+)/metrics", line)
            if match:
                server = cls(process, match.group(1), match.group(2))
                server.ray_temp_dir = temp_dir
                return server
        os.killpg(process.pid, signal.SIGKILL)  # serve and anything in its group
        raise RuntimeError(f"serve did not start within {start_timeout_s:.0f} s")

    def channel(self, index: int) -> grpc.aio.Channel:
        while len(self._channels) <= index // _STREAMS_PER_CHANNEL:
            self._channels.append(grpc.aio.insecure_channel(self.address))
        return self._channels[index // _STREAMS_PER_CHANNEL]

    async def warm_up(self) -> None:
        """A few requests, so each (prefill, decode) pair has carried one before the count."""
        for _ in range(4):
            await generate(self.channel(0), [5, 6, 7, 8], 2, 60.0)

    async def pool_blocks_used(self) -> dict[str, int]:
        text = await asyncio.to_thread(_fetch, self.metrics_url)
        status = parse_metrics(text)
        return {w.instance_id: w.num_blocks_used for w in status.workers}

    async def settled_pools(self, timeout_s: float = 10.0) -> dict[str, int]:
        """The pools once two readings 0.3 s apart agree (the gauges refresh every 0.1 s)."""
        deadline = time.monotonic() + timeout_s
        last = await self.pool_blocks_used()
        while time.monotonic() < deadline:
            await asyncio.sleep(0.3)
            now = await self.pool_blocks_used()
            if now == last:
                return now
            last = now
        return last

    def stop(self, timeout_s: float = 90.0) -> dict[str, Any]:
        """SIGTERM to serve's whole group, as systemd does; what was left behind."""
        pids = descendant_pids(self.process.pid)
        keep = os.environ.get("LOAD_CANCEL_RAY_LOGS")  # a folder: keep the workers' Ray logs
        if keep and self.ray_temp_dir:
            logs = Path(self.ray_temp_dir) / "session_latest" / "logs"
            shutil.copytree(logs, keep, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        began = time.monotonic()
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(10)
        seconds = time.monotonic() - began
        time.sleep(1.0)
        left = [pid for pid in pids if process_is_running(pid)]
        return {"exit_code": code, "seconds": round(seconds, 2), "processes_left": left}


def _echo(process: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    """serve's output to the queue, and to LOAD_CANCEL_SERVE_LOG (a file) when set."""
    log_path = os.environ.get("LOAD_CANCEL_SERVE_LOG")
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - lives as long as serve
    for line in process.stdout:  # type: ignore[union-attr]
        lines.put(line)
        if log is not None:
            log.write(line)
            log.flush()


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return str(answer.read().decode())


async def generate(
    channel: grpc.aio.Channel,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float,
    cancel_after_s: float | None = None,
) -> tuple[str, str]:
    """One stream; its outcome (a status code name, or CANCELLED_BY_CLIENT) and details."""
    request = pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    call = pb_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s)
    canceller = None
    if cancel_after_s is not None:
        canceller = asyncio.get_running_loop().call_later(cancel_after_s, call.cancel)
    try:
        async for _ in call:
            pass
        return "OK", ""
    except asyncio.CancelledError:
        if canceller is not None and call.cancelled():
            return "CANCELLED_BY_CLIENT", ""
        raise
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED and call.cancelled():
            return "CANCELLED_BY_CLIENT", ""
        return str(error.code().name), str(error.details())
    finally:
        if canceller is not None:
            canceller.cancel()


async def run_phase(
    server: Server, phase: Phase, timeout_s: float, seed: int, time_left_s: float
) -> PhaseResult:
    """Every request of the phase (at most `max_in_flight` at once); bounded by `time_left_s`."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(phase.max_in_flight or phase.num_requests)
    result = PhaseResult(phase.name, phase.num_requests)

    async def one(index: int) -> None:
        prompt = [rng.randrange(3, server.vocab_size) for _ in range(phase.prompt_len)]
        cancel = rng.random() < phase.cancel_fraction
        after = rng.uniform(0.05, phase.cancel_within_s) if cancel else None
        async with limit:
            code, details = await generate(
                server.channel(index), prompt, phase.max_tokens, timeout_s, after
            )
        result.codes[code] = result.codes.get(code, 0) + 1
        if details and len(result.examples.setdefault(code, [])) < 3:
            result.examples[code].append(details)

    began = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(phase.num_requests)]
    done, pending = await asyncio.wait(tasks, timeout=time_left_s)
    for task in pending:
        task.cancel()
    result.timed_out = bool(pending)
    for task in done:
        if task.exception() is not None:
            name = f"EXCEPTION:{type(task.exception()).__name__}"
            result.codes[name] = result.codes.get(name, 0) + 1
    result.seconds = round(time.monotonic() - began, 2)
    return result


async def monitor_health(server: Server, stop: asyncio.Event) -> dict[str, Any]:
    """Health twice a second and a one-token probe every two seconds, until `stop`."""
    health_channel = grpc.aio.insecure_channel(server.address)
    probe_channel = grpc.aio.insecure_channel(server.address)
    stub = health_pb2_grpc.HealthStub(health_channel)
    samples: list[dict[str, Any]] = []
    lies: list[dict[str, Any]] = []
    began = time.monotonic()
    tick = 0
    while not stop.is_set():
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            health = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as error:
            health = f"unreachable:{error.code().name}"
        if tick % 4 == 0:
            probe, _ = await generate(probe_channel, [5, 6, 7], 1, 10.0)
            sample = {"t": round(time.monotonic() - began, 1), "health": health, "probe": probe}
            samples.append(sample)
            serving_but_failing = health == "SERVING" and probe not in ("OK", *_OVERLOAD)
            if serving_but_failing or (health == "NOT_SERVING" and probe == "OK"):
                lies.append(sample)
        tick += 1
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    await health_channel.close()
    await probe_channel.close()
    return {"num_samples": len(samples), "num_lies": len(lies), "lies": lies[:20]}


async def wait_for_pools(server: Server, before: dict[str, int], settle_s: float) -> dict:
    """Whether every pool is back at `before` within `settle_s` of the last request's end."""
    began = time.monotonic()
    now: dict[str, int] = {}
    while True:
        now = await server.pool_blocks_used()
        if now == before:
            return {"returned": True, "seconds": round(time.monotonic() - began, 2), "after": now}
        if time.monotonic() - began > settle_s:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(5.0)  # how far off, a little later: a slow return or a leak
    later = await server.pool_blocks_used()
    return {"returned": False, "after": now, "after_5s": later}
