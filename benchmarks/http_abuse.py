"""The router's memory and /health latency while clients push huge bodies at the HTTP API.

    python -m benchmarks.http_abuse [--bodies 4] [--body-mb 100] [--out PATH]

A router (synthetic workers, router/synthetic.py) runs in a process of its own, so its RSS is
its own. A `/health` prober asks every 10 ms, first with nothing else going on (the baseline),
then while `--bodies` clients at once POST `--body-mb` MB bodies to /v1/completions, one after
another for `--seconds`, half with a Content-Length, half chunked, as fast as loopback takes
them. Each must get 413 (router.http_max_body_bytes); the router's RSS is sampled every 10 ms
from /proc.

Targets: RSS grows by less than 100 MB over its start; /health answers within 50 ms throughout
(its worst latency under load; the ratio to the idle baseline's worst is reported too). Prints
one JSON object as the last line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.router_load import _default_model_dir

MAX_RSS_GROWTH_MB = 100
MAX_HEALTH_MS = 50
_PROBE_INTERVAL_S = 0.01
_CHUNK = 1024 * 1024


def _serve(model_dir: str, port_out: Any) -> None:
    """The router process: serve until SIGTERM."""
    import asyncio

    from router.config import RouterConfig
    from router.server import Router
    from router.synthetic import synthetic_cluster

    async def main() -> None:
        prefill, decode = synthetic_cluster(1, 1)
        router = Router(RouterConfig(model_dir=model_dir, http_port=0), prefill, decode)
        await router.start()
        port_out.send(router.http_port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await router.stop(grace_s=1.0)

    asyncio.run(main())


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _probe_health(port: int, stop: threading.Event, latencies_ms: list[float]) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while not stop.is_set():
        started = time.perf_counter()
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
        latencies_ms.append((time.perf_counter() - started) * 1000)
        time.sleep(_PROBE_INTERVAL_S)
    connection.close()


def _push_bodies(
    port: int, num_bytes: int, chunked: bool, until: float, answers: list[bytes]
) -> None:
    """One body after another (at least one) until `until` (time.monotonic())."""
    _push_body(port, num_bytes, chunked, answers)
    while time.monotonic() < until:
        _push_body(port, num_bytes, chunked, answers)


def _push_body(port: int, num_bytes: int, chunked: bool, answers: list[bytes]) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += (
        b"Transfer-Encoding: chunked\r\n\r\n"
        if chunked
        else b"Content-Length: %d\r\n\r\n" % (num_bytes)
    )
    piece = b"x" * _CHUNK
    frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(head)
            for _ in range(num_bytes // _CHUNK):
                sock.sendall(frame)
        except OSError:
            pass  # the server answered and hung up
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except OSError:
            pass
        answers.append(answer)


def _watch(pid: int, port: int, seconds: float | None, work: list[threading.Thread]) -> dict:
    """Probe /health and sample RSS for `seconds`, or while `work` runs."""
    stop = threading.Event()
    latencies_ms: list[float] = []
    prober = threading.Thread(target=_probe_health, args=(port, stop, latencies_ms))
    prober.start()
    start_rss = peak_rss = _rss_mb(pid)
    for thread in work:
        thread.start()
    started = time.monotonic()
    while (seconds is not None and time.monotonic() - started < seconds) or any(
        thread.is_alive() for thread in work
    ):
        peak_rss = max(peak_rss, _rss_mb(pid))
        time.sleep(0.01)
    stop.set()
    prober.join()
    return {
        "rss_start_mb": round(start_rss, 1),
        "rss_peak_mb": round(peak_rss, 1),
        "rss_growth_mb": round(peak_rss - start_rss, 1),
        "health_probes": len(latencies_ms),
        "health_max_ms": round(max(latencies_ms), 2),
        "health_median_ms": round(sorted(latencies_ms)[len(latencies_ms) // 2], 2),
        "seconds": round(time.monotonic() - started, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    context = mp.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    server = context.Process(target=_serve, args=(args.model_dir or _default_model_dir(), sender))
    server.start()
    try:
        assert receiver.poll(60), "the router did not start"
        port = receiver.recv()
        assert server.pid is not None
        baseline = _watch(server.pid, port, 2.0, [])
        answers: list[bytes] = []
        num_bytes = args.body_mb * 1024 * 1024
        until = time.monotonic() + args.seconds
        pushers = [
            threading.Thread(
                target=_push_bodies, args=(port, num_bytes, index % 2 == 1, until, answers)
            )
            for index in range(args.bodies)
        ]
        loaded = _watch(server.pid, port, None, pushers)
        after = _rss_mb(server.pid)
    finally:
        os.kill(server.pid or 0, signal.SIGTERM)
        server.join(30)
    statuses = sorted({answer.split(b" ", 2)[1].decode() for answer in answers if answer})
    return {
        "benchmark": "http_abuse",
        "bodies": args.bodies,
        "body_mb": args.body_mb,
        "bodies_sent": len(answers),
        "statuses": statuses,
        "baseline": baseline,
        "under_bodies": loaded,
        "rss_after_mb": round(after, 1),
        "health_max_ratio": round(loaded["health_max_ms"] / baseline["health_max_ms"], 2),
        "targets": {
            "rss_growth_mb": f"< {MAX_RSS_GROWTH_MB}",
            "health_max_ms": f"<= {MAX_HEALTH_MS}",
            "statuses": "all 413",
        },
        "met": {
            "rss_growth_mb": loaded["rss_growth_mb"] < MAX_RSS_GROWTH_MB,
            "health_max_ms": loaded["health_max_ms"] <= MAX_HEALTH_MS,
            "statuses": statuses == ["413"] and all(answers),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bodies", type=int, default=4, help="concurrent huge bodies")
    parser.add_argument("--body-mb", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=3.0, help="keep sending bodies this long")
    parser.add_argument("--model-dir", help="folder with the tokenizer (default: the tiny one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    line = json.dumps(run(args))
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
