"""What a simulation is given and what it returns: the instances, the KV link, the options (the
serving path's terms, pdserve's dispatch) and the per-request result (planner/simulator.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.latency import StepModel

COLOCATED_POLICIES = ("vllm", "chunked")


@dataclass(frozen=True)
class InstanceSpec:
    """One instance: a step model (profile at tp, pp) and its KV capacity in tokens."""

    model: StepModel
    tp: int = 1
    kv_capacity: int | None = None  # None: memory is not limited
    node: int = 0  # which node; transfers between nodes use the cross-node link


@dataclass(frozen=True)
class LinkSpec:
    """How KV moves: bytes per token, GB/s within a node and across nodes, per-message ms.
    `enabled=False` is DistServe's model: the transfer is free and instant."""

    bytes_per_token: float = 0.0
    intra_node_GBps: float = 300.0
    cross_node_GBps: float = 3.125
    per_message_ms: float = 0.0
    enabled: bool = True
    # Latency of the hand-off beyond the wire (reservation, dial, the decode loop noticing the
    # landed KV); it delays the request but does not hold the link.
    handoff_ms: float = 0.0
    # What moving one request's KV costs the cores at either end, (ms per request, ms per
    # token): the sender's gather and socket writes lengthen its prefill step; the receiver's
    # reads and landing lengthen the decode step that follows (pdserve profile --path).
    send_cpu_ms: tuple[float, float] = (0.0, 0.0)
    receive_cpu_ms: tuple[float, float] = (0.0, 0.0)

    def send_ms(self, num_tokens: int) -> float:
        return self.send_cpu_ms[0] + self.send_cpu_ms[1] * num_tokens

    def receive_ms(self, num_tokens: int) -> float:
        return self.receive_cpu_ms[0] + self.receive_cpu_ms[1] * num_tokens


@dataclass(frozen=True)
class SimOptions:
    distserve_compat: bool = False
    prefill_max_tokens: int | None = None  # None: the prefill instance's KV capacity, or no cap
    colocated_policy: str = "vllm"
    max_num_batched_tokens: int = 2048  # chunked policy
    chunk_size: int = 512  # chunked policy
    max_num_seqs: int | None = None
    # DistServe's decode model: a FIFO whose step takes Σ(ctx + 1) <= this (None: ours, groups
    # under the KV memory with preemption).
    decode_batch_tokens: int | None = None
    # The serving path's own latency to a first token (router and gRPC hops), added to TTFT.
    ttft_path_ms: float = 0.0
    # Every step takes this many times its modelled time: the share of the instances' cores
    # that other processes (router, client) take at this load (1: the cores are theirs alone).
    step_scale: float = 1.0
    # pdserve's dispatch (router/dispatch.py): a disaggregated request reaches the prefill
    # queue only once its decode instance has reserved its KV, which that instance's loop does
    # between steps; so it waits out the decode step under way, and its KV goes to that
    # instance. Off: DistServe's model (the decode instance is picked when the KV is ready).
    reserve_before_prefill: bool = False

    def __post_init__(self) -> None:
        if self.colocated_policy not in COLOCATED_POLICIES:
            raise ValueError(f"colocated_policy must be one of {COLOCATED_POLICIES}")
        if self.step_scale <= 0:
            raise ValueError(f"step_scale must be > 0, got {self.step_scale}")
        if self.decode_batch_tokens is not None and self.colocated_policy == "chunked":
            raise ValueError("decode_batch_tokens (DistServe's decode) needs the vllm policy")
        if self.chunk_size < 1 or self.max_num_batched_tokens < self.chunk_size:
            raise ValueError("need 1 <= chunk_size <= max_num_batched_tokens")


@dataclass
class SimResult:
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray
    num_preemptions: int = 0
    end_ms: float = 0.0
    transfer_ms_total: float = 0.0
    num_steps: int = 0  # steps every instance ran (each emits tokens: the relay's wake-ups)
    busy_ms: tuple[float, ...] = ()  # each instance's first-stage step time: colocated,
    # then prefill, then decode instances
    devices: tuple[int, ...] = ()  # each instance's devices (tp * pp), in the same order

    def all_busy(self, num_devices: int) -> float:
        """The chance that no device is idle at a moment of the run: an instance's devices
        step together, each instance busy for its share of the run independently of the
        others (0 with a device that no instance holds)."""
        if self.end_ms <= 0 or sum(self.devices) < num_devices:
            return 0.0
        chance = 1.0
        for busy in self.busy_ms:
            chance *= min(busy / self.end_ms, 1.0)
        return chance
