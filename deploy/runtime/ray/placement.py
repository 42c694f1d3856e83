"""Where every worker process goes: placement groups, claimed resources, CPU core sets.

    an instance at TP=k>1 (any role) -> its own STRICT_PACK group, bundles [rank 0, ..., rank k-1]:
                                        every rank on one node (the TP collectives stay local)
    the TP=1 instances of one role   -> one SPREAD group, one bundle per instance: prefill,
                                        decode, colocated or adaptive replicas land on different
                                        nodes where there are several

Every layout (ClusterSpec.instances(): disaggregated, colocated, adaptive) is placed by these
two rules. Each bundle is {"CPU": num_cpus_per_worker} plus {"GPU": share} on CUDA (Ray then
sets CUDA_VISIBLE_DEVICES for the actor) plus the role's custom resources (e.g. {"node_a":
0.01}: a real cluster labels its node groups this way, and the multi-node tests do too).
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
class PlannedInstance:
    """One instance to place: its name, role, TP size and the custom resources of its role."""

    instance_id: str
    role: Role
    tp_size: int
    resources: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementPlan:
    """What the placement logic needs from the cluster config."""

    instances: tuple[PlannedInstance, ...]
    device: str = "cpu"
    num_cpus_per_worker: float = 1.0
    gpus_per_rank: float = 1.0  # below 1: ranks share GPUs (see gpus_per_rank)

    def resources(self, role: Role) -> dict[str, float]:
        """The custom resources of `role`'s bundles ({} when it has no instance)."""
        return next((dict(i.resources) for i in self.instances if i.role == role), {})


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
    """Create the placement groups (not yet ready: see `wait_until_placed`), in the plan's
    instance order."""
    groups: dict[str, tuple[PlacementGroup, tuple[int, ...]]] = {}
    spread: dict[Role, list[PlannedInstance]] = {}
    for instance in plan.instances:
        if instance.tp_size > 1:
            bundles = [_bundle(plan, instance.resources)] * instance.tp_size
            name = name_prefix + instance.instance_id
            group = placement_group(bundles, strategy="STRICT_PACK", name=name)
            groups[instance.instance_id] = (group, tuple(range(instance.tp_size)))
        else:
            spread.setdefault(instance.role, []).append(instance)
    for role, replicas in spread.items():
        bundles = [_bundle(plan, i.resources) for i in replicas]
        group = placement_group(bundles, strategy="SPREAD", name=f"{name_prefix}{role.value}")
        groups.update({i.instance_id: (group, (j,)) for j, i in enumerate(replicas)})
    num_gpus = plan.gpus_per_rank if plan.device.startswith("cuda") else 0.0
    placements, next_worker = [], 0
    for instance in plan.instances:
        group, bundle_indices = groups[instance.instance_id]
        workers = tuple(range(next_worker, next_worker + instance.tp_size))  # each rank's cores
        next_worker += instance.tp_size
        placements.append(
            InstancePlacement(
                instance.instance_id,
                instance.role,
                instance.tp_size,
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
