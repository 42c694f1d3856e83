"""Which GPU a TP rank uses: the one its runtime gave it, never simply `cuda:<tp_rank>`.

    runtime                      what the rank process sees              device
    Ray, actor with num_gpus=1   ray.get_gpu_ids() == ["3"]; Ray sets    cuda:0 (its one device)
                                 CUDA_VISIBLE_DEVICES=3
    Ray, ids not made visible    ray ids ["3"], every GPU visible        cuda:3
    local, k GPUs per worker     CUDA_VISIBLE_DEVICES="4,5" (k=2)        cuda:<tp_rank>
    local, one GPU shared        CUDA_VISIBLE_DEVICES="0" (or one GPU)   cuda:0 for every rank
                                 (same-node transport, memory shares)

`cuda_index` is pure, so the choice is tested on CPU with these inputs emulated; `rank_device`
reads them from the process. CUDA's current device is per thread: `bind_thread` sets it on each
thread that touches the GPU, `device_thread` starts such a thread.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence

import torch


def cuda_index(
    tp_rank: int,
    device_count: int,
    visible: Sequence[str] | None,
    ray_gpu_ids: Sequence[str],
) -> int:
    """The CUDA ordinal for TP rank `tp_rank`. `visible`: CUDA_VISIBLE_DEVICES split (None when
    unset); `ray_gpu_ids`: ray.get_gpu_ids() in a Ray actor, else empty."""
    if device_count < 1:
        raise RuntimeError("device is cuda but this process sees no GPU")
    if len(ray_gpu_ids) == 1:  # a Ray actor given one GPU: find it among what it sees
        gpu = str(ray_gpu_ids[0])
        if visible is not None and gpu in visible:
            return list(visible).index(gpu)
        if visible is None and gpu.isdigit() and int(gpu) < device_count:
            return int(gpu)
        return 0
    if device_count == 1:
        return 0  # one GPU for the whole process tree: every rank shares it
    if tp_rank >= device_count:
        raise RuntimeError(
            f"TP rank {tp_rank} needs its own GPU and this process sees {device_count} "
            f"(CUDA_VISIBLE_DEVICES={','.join(visible) if visible is not None else 'unset'})"
        )
    return tp_rank


def _ray_gpu_ids() -> list[str]:
    ray = sys.modules.get("ray")  # only a process that runs Ray has it imported
    if ray is None or not ray.is_initialized():
        return []
    try:
        return [str(gpu) for gpu in ray.get_gpu_ids()]
    except Exception:  # the driver, or a Ray without GPU bookkeeping here
        return []


def rank_device(device: str, tp_rank: int) -> torch.device:
    """The device of TP rank `tp_rank` for an engine configured with `device` ("cpu",
    "cuda", or an explicit "cuda:N", which is taken as given)."""
    if device != "cuda":
        return torch.device(device)
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = None if names is None else [n.strip() for n in names.split(",") if n.strip()]
    index = cuda_index(tp_rank, torch.cuda.device_count(), visible, _ray_gpu_ids())
    return torch.device("cuda", index)


def bind_thread(device: torch.device | str | None) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for a CPU device).

    CUDA's current device belongs to each thread, and every new thread starts on device 0: a
    thread that launches a Triton kernel, records an event, builds an NCCL communicator or
    copies KV on a rank whose GPU is not device 0 must say so first. Every thread the engine,
    the KV transfer or a worker starts calls this before touching CUDA (`device_thread`)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_thread(
    device: torch.device | str | None,
    target: Callable[..., object],
    name: str,
    args: tuple[object, ...] = (),
    daemon: bool = True,
) -> threading.Thread:
    """A thread (not started) that binds `device` (see `bind_thread`), then runs `target`."""

    def run() -> None:
        bind_thread(device)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=daemon)
