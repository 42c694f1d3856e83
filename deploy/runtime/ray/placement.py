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
    num_gpus: int

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

    @property
    def num_workers(self) -> int:
        return (
            self.num_prefill_instances * self.prefill_tp_size
            + self.num_decode_instances * self.decode_tp_size
        )


def _bundle(plan: PlacementPlan, extra: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": plan.num_cpus_per_worker, **extra}
    if plan.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    return bundle


def place_instances(plan: PlacementPlan, name_prefix: str) -> list[InstancePlacement]:
    """Create the placement groups (not yet ready: see `wait_until_placed`)."""
    num_gpus = 1 if plan.device.startswith("cuda") else 0
    placements: list[InstancePlacement] = []
    next_worker = 0

    def instance(
        instance_id: str, role: Role, tp: int, group: PlacementGroup, bundles: tuple[int, ...]
    ) -> None:
        nonlocal next_worker
        workers = tuple(range(next_worker, next_worker + tp))
        next_worker += tp
        placements.append(InstancePlacement(
            instance_id, role, tp, group, bundles, workers, plan.num_cpus_per_worker, num_gpus
        ))  # fmt: skip

    for i in range(plan.num_prefill_instances):
        bundle = _bundle(plan, plan.prefill_resources)
        group = placement_group(
            [bundle] * plan.prefill_tp_size,
            strategy="STRICT_PACK",
            name=f"{name_prefix}prefill-{i}",
        )
        instance(f"prefill-{i}", Role.PREFILL, plan.prefill_tp_size, group,
                 tuple(range(plan.prefill_tp_size)))  # fmt: skip
    bundle = _bundle(plan, plan.decode_resources)
    if plan.decode_tp_size == 1:
        group = placement_group(
            [bundle] * plan.num_decode_instances, strategy="SPREAD", name=f"{name_prefix}decode"
        )
        for j in range(plan.num_decode_instances):
            instance(f"decode-{j}", Role.DECODE, 1, group, (j,))
    else:
        for j in range(plan.num_decode_instances):
            group = placement_group(
                [bundle] * plan.decode_tp_size,
                strategy="STRICT_PACK",
                name=f"{name_prefix}decode-{j}",
            )
            instance(f"decode-{j}", Role.DECODE, plan.decode_tp_size, group,
                     tuple(range(plan.decode_tp_size)))  # fmt: skip
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
