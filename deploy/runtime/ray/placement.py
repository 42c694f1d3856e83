"""Where every worker process goes: placement groups, claimed resources, CPU core sets.

    prefill instance i (TP=k) -> its own STRICT_PACK group, bundles [rank 0, ..., rank k-1]:
                                 every rank on one node (the TP collectives stay local)
    decode instances (TP=1)   -> one SPREAD group, one bundle per instance: replicas land on
                                 different nodes where there are several
    decode instance j (TP>1)  -> its own STRICT_PACK group, like a prefill instance

Each bundle is {"CPU": num_cpus_per_worker} plus {"GPU": 1} on CUDA (Ray then sets
CUDA_VISIBLE_DEVICES for the actor) plus the role's custom resources (e.g. {"node_a": 0.01}: a
real cluster labels its prefill and decode nodes this way, and the multi-node test does too).
On CPU, each worker pins itself to its own core set (`pin_to_core_set`), so the ranks of a TP
group do not fight over one core while another core idles.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from worker.protocol import Role


@dataclass(frozen=True)
class InstancePlacement:
    """One instance's ranks: rank r runs in `bundle_indices[r]` of `placement_group`."""

    instance_id: str
    role: Role
    tp_size: int
    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...]
    worker_indices: tuple[int, ...]  # cluster-wide index of each rank (its core set)
    num_cpus: float
    num_gpus: float

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=self.bundle_indices[rank]
        )


@dataclass(frozen=True)
class PlacementPlan:
    """What the placement logic needs from the cluster config."""

    num_prefill_instances: int
    prefill_tp_size: int
    num_decode_instances: int
    decode_tp_size: int
    device: str = "cpu"
    num_cpus_per_worker: float = 1.0
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    gpus_per_rank: float = 1.0  # below 1: ranks share GPUs (see gpus_per_rank)


def _bundle(plan: PlacementPlan, extra: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": plan.num_cpus_per_worker, **extra}
    if plan.device.startswith("cuda"):
        bundle["GPU"] = plan.gpus_per_rank
    return bundle


def gpus_per_rank(transport: str, tp_sizes: list[int], cluster_gpus: float) -> float:
    """The GPU share of each rank actor. One each, unless the ranks outnumber the GPUs and no
    GPU must hold two ranks of one NCCL group: every instance at TP=1 and the KV over the
    same-node transport (CUDA IPC, not NCCL). Then the ranks split the GPUs evenly (one GPU:
    the default disaggregated layout, each process with its own KV pool)."""
    num_ranks = sum(tp_sizes)
    if transport == "network" or max(tp_sizes) > 1 or not 0 < cluster_gpus < num_ranks:
        return 1.0
    return math.floor(100 * cluster_gpus / num_ranks) / 100


def place_instances(plan: PlacementPlan, name_prefix: str) -> list[InstancePlacement]:
    """Create the placement groups (not yet ready: see `wait_until_placed`)."""
    groups: list[tuple[str, Role, int, PlacementGroup, tuple[int, ...]]] = []

    def packed(instance_id: str, role: Role, tp: int, resources: dict[str, float]) -> None:
        bundles = [_bundle(plan, resources)] * tp
        group = placement_group(bundles, strategy="STRICT_PACK", name=name_prefix + instance_id)
        groups.append((instance_id, role, tp, group, tuple(range(tp))))

    for i in range(plan.num_prefill_instances):
        packed(f"prefill-{i}", Role.PREFILL, plan.prefill_tp_size, plan.prefill_resources)
    if plan.decode_tp_size == 1:
        bundles = [_bundle(plan, plan.decode_resources)] * plan.num_decode_instances
        group = placement_group(bundles, strategy="SPREAD", name=f"{name_prefix}decode")
        groups += [(f"decode-{j}", Role.DECODE, 1, group, (j,)) for j in range(len(bundles))]
    else:
        for j in range(plan.num_decode_instances):
            packed(f"decode-{j}", Role.DECODE, plan.decode_tp_size, plan.decode_resources)
    num_gpus = plan.gpus_per_rank if plan.device.startswith("cuda") else 0.0
    placements, next_worker = [], 0
    for instance_id, role, tp, group, bundle_indices in groups:
        workers = tuple(range(next_worker, next_worker + tp))  # each rank's core set
        next_worker += tp
        placements.append(
            InstancePlacement(
                instance_id,
                role,
                tp,
                group,
                bundle_indices,
                workers,
                plan.num_cpus_per_worker,
                num_gpus,
            )
        )
    return placements


def wait_until_placed(placements: list[InstancePlacement], timeout_s: float) -> None:
    """Every group reserved, or RuntimeError saying what the cluster lacks."""
    groups = {id(p.placement_group): p.placement_group for p in placements}
    ready, pending = ray.wait(
        [group.ready() for group in groups.values()], num_returns=len(groups), timeout=timeout_s
    )
    if pending:
        raise RuntimeError(
            f"{len(pending)} of {len(groups)} placement groups could not be reserved within "
            f"{timeout_s:.0f}s; the cluster has {ray.available_resources()}, each worker needs "
            f"{placements[0].placement_group.bundle_specs[0]} (lower num_cpus_per_worker, add "
            "nodes or GPUs, or check the custom resources the config asks for)"
        )


def remove_placements(placements: list[InstancePlacement]) -> None:
    removed: set[int] = set()
    for placement in placements:
        group = placement.placement_group
        if id(group) not in removed:
            removed.add(id(group))
            try:
                remove_placement_group(group)
            except Exception:  # noqa: S110 - the cluster may be gone already
                pass


def core_set(worker_index: int, num_workers: int) -> set[int]:
    """This worker's share of the cores this process may use (round robin when scarce)."""
    cores = sorted(os.sched_getaffinity(0))
    per_worker = max(1, len(cores) // max(1, num_workers))
    start = (worker_index * per_worker) % len(cores)
    return set(cores[start : start + per_worker])


def pin_to_core_set(cores: set[int]) -> None:
    """Pin every thread of this process (Ray's included) and the threads it starts later."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:
            pass  # a thread that ended meanwhile
