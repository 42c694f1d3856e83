"""How much the Ray GCS grows per request served: its RSS before and after N short requests.

    python -m benchmarks.ray_gcs_memory --model MODEL_DIR --requests 2000

Starts a one-prefill (TP=2), one-decode RayCluster on 127.0.0.1, sends the requests (64 at a
time), then prints one JSON line: gcs_server's RSS in MB at start, after the requests, and after
a further 10 s idle (the load refresh keeps calling the workers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from benchmarks.load_cancel_run import generate
from deploy.config.cluster_spec import build_cluster_spec
from deploy.config.serve_config import parse_config
from deploy.runtime.ray.cluster import RayCluster


def gcs_rss_mb(pids: list[int]) -> float:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmd, open(f"/proc/{pid}/status") as st:
                if b"gcs_server" in cmd.read():
                    rss = next(line for line in st if line.startswith("VmRSS"))
                    return int(rss.split()[1]) / 1024
        except OSError:
            continue
    return -1.0


async def send(address: str, num_requests: int) -> dict[str, int]:
    import grpc

    codes: dict[str, int] = {}
    limit = asyncio.Semaphore(64)
    async with grpc.aio.insecure_channel(address) as channel:

        async def one(i: int) -> None:
            async with limit:
                code, _ = await generate(channel, [5 + i % 50, 6, 7, 8], 4, 60.0)
            codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(one(i) for i in range(num_requests)))
    return codes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    config = parse_config(
        {
            "model": args.model,
            "prefill": {"tensor_parallel_size": 2},
            "kv_cache": {"num_blocks": 256},
            "router": {"port": 0, "shutdown_grace_s": 5},
        }
    )
    with RayCluster(build_cluster_spec(config)) as cluster:
        cluster.start()
        time.sleep(3)
        start = gcs_rss_mb(cluster.pids())
        began = time.monotonic()
        codes = asyncio.run(send(cluster.address, args.requests))
        seconds = time.monotonic() - began
        after = gcs_rss_mb(cluster.pids())
        time.sleep(10)
        idle = gcs_rss_mb(cluster.pids())
    print(
        json.dumps(
            {
                "requests": args.requests,
                "codes": codes,
                "seconds": round(seconds, 1),
                "gcs_rss_mb": {"start": start, "after": after, "after_idle_10s": idle},
            }
        )
    )


if __name__ == "__main__":
    main()
