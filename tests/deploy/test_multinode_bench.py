"""The multi-node benchmark of docs/guides/multinode-ray.md, run as the guide writes it, so the
guide cannot rot: its two config files (read from the page) served by `pdserve serve` on a
simulated two-node Ray cluster, and its `pdserve bench --compare --target ...` command, whose
load driver runs as Ray tasks on those nodes (`--ray-address`).

Scaled down (`SHORT`): the tiny benchmark model on CPU in float32, one instance per role, free
ports for the guide's 50051/50052, six requests at one rate, the packaged ShareGPT copy. The
nodes are `ray.cluster_utils.Cluster` nodes on 127.0.0.1, labelled node_a and node_b as node
groups are, with a Ray temp dir of their own; every process started is stopped by id.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.goodput import layouts
from deploy.runtime.ray.node import REPO_ROOT
from tests.deploy.ray_support import two_ray_nodes
from tests.deploy.test_serve_signals import Serve

pytestmark = pytest.mark.slow  # two clusters and a benchmark: about a minute

GUIDE = REPO_ROOT / "docs" / "guides" / "multinode-ray.md"
NUM_REQUESTS = 6


def guide_section() -> str:
    text = GUIDE.read_text()
    return text[text.index("## The goodput benchmark on a multi-node cluster") :]


def guide_configs() -> dict[str, dict[str, Any]]:
    """The config files of step 2, by file name (each block's first line names its file)."""
    blocks = re.findall(r"```yaml\n# (\S+\.yaml)[^\n]*\n(.*?)```", guide_section(), re.S)
    return {name: yaml.safe_load(body) for name, body in blocks}


def guide_commands() -> list[list[str]]:
    """Every `pdserve ...` command of steps 2 and 3, continuation lines joined, `&` dropped."""
    section = guide_section()
    section = section[: section.index("### Rehearsed on one machine")]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#")[0].rstrip(" &"))
            if words[:1] == ["pdserve"]:
                commands.append(words)
    return commands


def short(config: dict[str, Any], model_dir: Path, address: str, port: int) -> dict[str, Any]:
    """A guide config scaled down to this machine."""
    config = {**config, "model": str(model_dir), "device": "cpu", "dtype": "float32"}
    for role in ("prefill", "decode", "colocated", "adaptive"):
        if role in config:
            config[role] = {**config[role], "instances": 1}
    config["router"] = {**config["router"], "host": "127.0.0.1", "port": port}
    config["ray"] = {**config["ray"], "address": address}
    config["kv_cache"] = {"num_blocks": 256}
    return config


@pytest.fixture()
def two_nodes() -> Iterator[str]:
    # 4 logical CPUs a node: the workers of both layouts and a load-driver task per node
    with two_ray_nodes(num_cpus=4) as address:
        yield address


def test_the_guide_s_benchmark_runs_on_two_nodes(two_nodes: str, tmp_path: Path) -> None:
    configs = guide_configs()
    assert sorted(configs) == ["bench-colocated.yaml", "bench-disaggregated.yaml"]
    serves: list[list[str]] = []
    benches: list[list[str]] = []
    for words in guide_commands():
        (serves if words[1] == "serve" else benches).append(words)
    assert [words[:3] for words in serves] == [
        ["pdserve", "serve", "--config"],
        ["pdserve", "serve", "--config"],
    ]
    (bench,) = [words for words in benches if "--compare" in words]
    model_dir = layouts.ensure_bench_model(tmp_path / "model", "tiny")
    ports = {"50051": _free_port(), "50052": _free_port()}
    started: list[Serve] = []
    try:
        for words in serves:
            name = words[3]
            config = configs[name]
            port = ports[str(config["router"]["port"])]
            (tmp_path / name).write_text(yaml.safe_dump(short(config, model_dir, two_nodes, port)))
            started.append(_serve(tmp_path, name))
        for serve in started:
            serve.wait_for("serving on ", 150)
        out = tmp_path / "out"
        argv = _short_bench(bench, model_dir, two_nodes, ports, out)
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert set(summary["goodputs"]) == {"disaggregated", "colocated"}
        raw = json.loads((out / "raw" / "sharegpt.json").read_text())
        for name in ("disaggregated", "colocated"):
            (point,) = raw["layouts"][name]["points"]
            assert [r["error"] for r in point["records"]] == [""] * NUM_REQUESTS
            # one load-driver shard per node: Ray tasks (a local run would have one process)
            assert [clock["shard"] for clock in point["clocks"]] == [0, 1]
        for kind in ("attainment_vs_rate", "latency_cdf", "ttft_breakdown"):
            assert (out / f"sharegpt_{kind}.png").read_bytes()[:4] == b"\x89PNG"
        for serve in started:
            serve.signal_group(signal.SIGTERM)
            assert serve.process.wait(60) == 0, serve.output()
    finally:
        for serve in started:
            serve.kill()


def _serve(folder: Path, config_name: str) -> Serve:
    """`pdserve serve --config NAME` in a session of its own (the guide's `&`)."""
    return Serve.command(["pdserve", "serve", "--config", str(folder / config_name)])


def _short_bench(
    words: list[str], model_dir: Path, address: str, ports: dict[str, int], out: Path
) -> list[str]:
    """The guide's bench command on this machine: its flags kept, its values scaled down."""
    argv = []
    skip = False
    for index, word in enumerate(words):
        if skip:
            skip = False
            continue
        flag = words[index - 1] if index else ""
        if word == "--sharegpt" and not words[index + 1].startswith("--"):
            argv.append(word)  # the packaged copy, not a downloaded file
            skip = True
            continue
        if flag == "--target":
            name, rest = word.split("=", 1)
            port = rest.split(":")[1]
            word = f"{name}=127.0.0.1:{ports[port]}:{rest.split(':')[2]}"
        elif flag == "--model-dir":
            word = str(model_dir)
        elif flag == "--out":
            word = str(out)
        elif flag == "--num-requests":
            word = str(NUM_REQUESTS)
        elif flag == "--ray-address":
            word = address
        argv.append(word)
    return [*argv, "--rates", "2"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_guide_names_no_plain_process_fallback() -> None:
    assert "--no-ray" not in guide_section() and "plain processes" not in guide_section()
