"""TP ranks 1..k-1 as Ray actors: the RankLauncher (engine/ranks.py) deploy/ hands the Executor.

The instance's driver actor (rank 0, bundle 0) starts one `RankActor` per other rank in bundles
1..k-1 of its STRICT_PACK placement group; each runs the same `run_rank(spec, report)` body as a
spawned process would. The RankSpec (master address and port of the TP group, picked by the
driver) travels as an actor-call argument: that is the process-group bootstrap over Ray.

    driver actor (rank 0) --RankActor.run(spec)--> rank actor j: init_tp_group, ModelRunner,
                          <--wait_ready()--------- "ready" | the traceback
    ... batches travel over the gloo/NCCL TP group, never through Ray ...

The RayCluster creates the rank actors together with the driver actor (`start_rank_actors`), so
their processes start in parallel. A restarted driver actor kills those and starts its own,
which Ray kills with it if it dies again (fate sharing). A rank actor exits when its `run`
ends (SHUTDOWN, or its driver is gone), so one whose driver is never restarted does not linger.
`stop` waits for each `run` to end, then kills what is left.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import ray

from deploy.runtime.ray.placement import InstancePlacement, core_set, pin_to_core_set

if TYPE_CHECKING:  # the driver creates RankActors without importing torch or the model code
    from engine.ranks import RankSpec


class RankActor:
    """One non-driver TP rank. Threaded (max_concurrency=2): `run` blocks for the rank's whole
    life while `wait_ready` answers."""

    def __init__(self, worker_index: int, num_workers: int, pin_cores: bool) -> None:
        if pin_cores:
            pin_to_core_set(core_set(worker_index, num_workers))
        import engine.model_runner  # noqa: F401 - import now, while the driver rank still loads

        self._reported = threading.Event()
        self._state = ("", "")

    def run(self, spec: RankSpec) -> None:
        from engine.ranks import run_rank

        def report(state: str, rank: int, detail: str) -> None:
            self._state = (state, detail)
            self._reported.set()

        try:
            run_rank(spec, report)
        finally:
            # Never reused: a restarted driver kills its old rank actors and starts its own. And
            # should no restart come (its node is gone), an idle actor would hold the model's
            # memory until the cluster stops. run_rank ended: SHUTDOWN, or the driver is gone.
            _leave()

    def wait_ready(self, timeout_s: float) -> tuple[str, str, int]:
        """("ready", "") | ("error", traceback) | ("timeout", ""), and this rank's process id."""
        if not self._reported.wait(timeout_s):
            return ("timeout", "", os.getpid())
        return (*self._state, os.getpid())


def _leave() -> None:
    try:
        ray.actor.exit_actor()
    except Exception:  # noqa: BLE001 - not in an actor after all (or Ray refused): leave anyway
        os._exit(0)


def rank_actor_name(instance_id: str, rank: int) -> str:
    return f"pdserve-{instance_id}-rank{rank}"


def start_rank_actors(
    placement: InstancePlacement, num_workers: int, pin_cores: bool, named: bool = False
) -> list[Any]:
    """RankActors for ranks 1..k-1 in their bundles, idle until `run`. The cluster creates them
    with the driver actor, so the ranks' processes start and import in parallel with it."""
    remote_cls = ray.remote(RankActor)
    return [
        remote_cls.options(
            name=rank_actor_name(placement.instance_id, rank) if named else None,
            max_concurrency=2,
            max_restarts=0,
            num_cpus=placement.num_cpus,
            enable_task_events=False,  # see deploy/runtime/ray/node.py: the GCS keeps no per-call record
            num_gpus=placement.num_gpus,
            scheduling_strategy=placement.strategy(rank),
        ).remote(placement.worker_indices[rank], num_workers, pin_cores)
        for rank in range(1, placement.tp_size)
    ]


class RayRankLauncher:
    """Runs ranks 1..k-1 of `placement` on RankActors (given, or started here); see the module
    docstring."""

    def __init__(
        self,
        placement: InstancePlacement,
        num_workers: int,
        pin_cores: bool,
        actors: list[Any] | None = None,
    ) -> None:
        self.placement = placement
        self.num_workers = num_workers
        self.pin_cores = pin_cores
        self.actors: list[Any] = list(actors or [])
        self._runs: list[Any] = []  # ObjectRef of each rank's `run`: done = the rank ended
        self._pids: list[int] = []

    def start(self, specs: list[RankSpec]) -> None:
        if not self.actors:
            self.actors = start_rank_actors(self.placement, self.num_workers, self.pin_cores)
        by_rank = dict(enumerate(self.actors, start=1))
        self._runs = [by_rank[spec.tp_rank].run.remote(spec) for spec in specs]

    def wait_ready(self, timeout_s: float) -> None:
        answers = ray.get(
            [a.wait_ready.remote(timeout_s) for a in self.actors], timeout=timeout_s + 10
        )
        for rank, (state, detail, _) in enumerate(answers, start=1):
            if state != "ready":
                raise RuntimeError(
                    f"TP rank {rank} of {self.placement.instance_id} failed to start: "
                    + (detail or f"not ready within {timeout_s:.0f}s")
                )
        self._pids = [pid for _, _, pid in answers]

    def dead(self) -> list[str]:
        if not self._runs:
            return []
        ended, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        return [
            f"TP rank {rank} of {self.placement.instance_id} (Ray actor ended)"
            for rank, run in enumerate(self._runs, start=1)
            if run in ended
        ]

    def pids(self) -> list[int]:
        return list(self._pids)

    def stop(self, join_timeout_s: float) -> None:
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=join_timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self._runs, self._pids = [], [], []
