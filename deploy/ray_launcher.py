"""TP ranks 1..k-1 as Ray actors: the RankLauncher (engine/ranks.py) that deploy/ hands the Executor.

The instance's driver actor (rank 0, bundle 0) starts one `RankActor` per other rank in bundles
1..k-1 of its STRICT_PACK placement group; each runs the same `run_rank(spec, report)` body as a
spawned process would. The RankSpec (master address and port of the TP group, picked by the
driver) travels as an actor-call argument: that is the process-group bootstrap over Ray.

    driver actor (rank 0) --RankActor.run(spec)--> rank actor j: init_tp_group, ModelRunner,
                          <--wait_ready()--------- "ready" | the traceback
    ... batches travel over the gloo/NCCL TP group, never through Ray ...

The rank actors are owned by the driver actor, so Ray kills them when it dies (fate sharing);
`stop` waits for their `run` to return after SHUTDOWN, then kills whatever is left.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray

from deploy.ray_placement import InstancePlacement, core_set, pin_to_core_set
from engine.ranks import RankSpec, run_rank


class RankActor:
    """One non-driver TP rank. Threaded (max_concurrency=2): `run` blocks for the rank's whole
    life while `wait_ready` answers."""

    def __init__(self, worker_index: int, num_workers: int, pin_cores: bool) -> None:
        if pin_cores:
            pin_to_core_set(core_set(worker_index, num_workers))
        self._reported = threading.Event()
        self._state = ("", "")

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: RankSpec) -> None:
        def report(state: str, rank: int, detail: str) -> None:
            self._state = (state, detail)
            self._reported.set()

        run_rank(spec, report)

    def wait_ready(self, timeout_s: float) -> tuple[str, str]:
        """("ready", "") | ("error", traceback) | ("timeout", "")."""
        if not self._reported.wait(timeout_s):
            return ("timeout", "")
        return self._state


class RayRankLauncher:
    """Starts ranks 1..k-1 of `placement` as RankActors; see the module docstring."""

    def __init__(self, placement: InstancePlacement, num_workers: int, pin_cores: bool) -> None:
        self.placement = placement
        self.num_workers = num_workers
        self.pin_cores = pin_cores
        self.actors: list[Any] = []
        self._runs: list[Any] = []  # ObjectRef of each rank's `run`: done = the rank ended
        self._pids: list[int] = []

    def start(self, specs: list[RankSpec]) -> None:
        remote_cls = ray.remote(RankActor)
        for spec in specs:
            actor = remote_cls.options(
                name=None, max_concurrency=2, max_restarts=0,
                num_cpus=self.placement.num_cpus, num_gpus=self.placement.num_gpus,
                scheduling_strategy=self.placement.strategy(spec.tp_rank),
            ).remote(
                self.placement.worker_indices[spec.tp_rank], self.num_workers, self.pin_cores
            )  # fmt: skip
            self.actors.append(actor)
            self._runs.append(actor.run.remote(spec))

    def wait_ready(self, timeout_s: float) -> None:
        answers = ray.get(
            [a.wait_ready.remote(timeout_s) for a in self.actors], timeout=timeout_s + 10
        )
        for rank, (state, detail) in enumerate(answers, start=1):
            if state != "ready":
                raise RuntimeError(
                    f"TP rank {rank} of {self.placement.instance_id} failed to start: "
                    + (detail or f"not ready within {timeout_s:.0f}s")
                )
        self._pids = ray.get([a.pid.remote() for a in self.actors], timeout=timeout_s)

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
