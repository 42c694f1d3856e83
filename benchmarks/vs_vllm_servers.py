"""The servers benchmarks/vs_vllm.py compares, each a process group of its own on 127.0.0.1.

    serving(command, env, port, log)  starts one, waits for GET /health to answer 200 (with a
                                      deadline), yields its base URL, stops it on the way out
    vllm_server(...)                  vLLM's OpenAI API server (its CPU build), both cores
    pdserve_server(...)               one pdserve layout: this module run as a program

    python -m benchmarks.vs_vllm_servers LAYOUT MODEL_DIR --http-port P [...]

serves one layout of benchmarks/goodput/layouts.cluster_spec (each worker pinned to a core of
its own) with the HTTP API on, until SIGTERM or SIGINT, then shuts the cluster down.

A server is stopped by process id: SIGTERM to its leader, which shuts down the processes it
started; past the grace period, and after the leader exits, SIGKILL to its whole group, so
nothing it left behind keeps the cores. Both get the same KV memory in all (KV_CACHE_GIB): vLLM
in its one pool, pdserve split evenly over its instances.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.goodput import layouts

KV_CACHE_GIB = 2
VLLM_MAX_MODEL_LEN = 2048
# No hub and no usage reports: the model is a local folder and nothing leaves this machine.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
REPO = Path(__file__).resolve().parents[1]


def vllm_server(python: str, model_dir: Path, name: str, port: int) -> tuple[list[str], dict]:
    """The command and environment of vLLM's API server, prefix caching off as pdserve's is
    (every rate replays the same prompts)."""
    command = [
        python,
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(model_dir), "--served-model-name", name),
        *("--dtype", "float32", "--max-model-len", str(VLLM_MAX_MODEL_LEN)),
        "--no-enable-prefix-caching",
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    env = {
        **os.environ,
        **OFFLINE_ENV,
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    }
    return command, env


def pdserve_server(
    layout: str,
    model_dir: Path,
    name: str,
    port: int,
    latency_profile: Path,
    slo_s: tuple[float, float],
) -> tuple[list[str], dict]:
    """The command and environment that serve one pdserve layout (this module's main)."""
    command = [
        sys.executable,
        *("-m", "benchmarks.vs_vllm_servers", layout, str(model_dir)),
        *("--http-port", str(port), "--served-model-name", name),
        *("--latency-profile", str(latency_profile)),
        *("--ttft-slo-s", str(slo_s[0]), "--tpot-slo-s", str(slo_s[1])),
    ]
    path = os.pathsep.join([str(REPO), str(REPO / "proto"), os.environ.get("PYTHONPATH", "")])
    return command, {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}


@contextmanager
def serving(
    command: list[str], env: dict, port: int, log: Path, start_timeout_s: float
) -> Iterator[str]:
    """Start the server in a new session (its own process group), wait until it is healthy,
    yield its base URL; stop it whatever happens."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(process, url, log, start_timeout_s)
        yield url
    finally:
        stop(process)


def wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{process.args[0]} exited with {process.returncode} before it was healthy; "
                f"the end of {log}:\n{tail(log)}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"no healthy server at {url} within {timeout_s:.0f} s; see {log}")


def stop(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the leader, then SIGKILL to whatever of its group is left."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the group's id is the leader's pid
    except ProcessLookupError:
        pass  # the group is empty: everything exited
    process.wait()


def tail(path: Path, num_chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.is_file() else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve one pdserve layout with HTTP on.")
    parser.add_argument("layout", choices=layouts.LAYOUTS)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--latency-profile", type=Path, default=layouts.DEFAULT_LATENCY_PROFILE)
    parser.add_argument("--ttft-slo-s", type=float, default=1.5, help="for adaptive placement")
    parser.add_argument("--tpot-slo-s", type=float, default=0.1, help="for adaptive placement")
    args = parser.parse_args(argv)
    num_instances = 1 if args.layout == "single" else 2  # the others: two one-core workers
    kv_bytes = KV_CACHE_GIB * 2**30 // num_instances
    spec = layouts.cluster_spec(
        args.layout,
        args.model_dir,
        pin_cpus=True,
        latency_profile=args.latency_profile,
        kv_cache_memory_bytes=kv_bytes,
    )
    # The vLLM client sends no SLOs: an adaptive router places by these defaults.
    router = dataclasses.replace(
        spec.router,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        default_ttft_slo_s=args.ttft_slo_s,
        default_tpot_slo_s=args.tpot_slo_s,
    )
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    cluster = layouts.start_local_cluster(dataclasses.replace(spec, router=router))
    try:
        print(f"serving {args.layout} on http://127.0.0.1:{args.http_port}", flush=True)
        while not stopping.wait(0.5):
            pass
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
