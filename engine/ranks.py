"""The non-driver TP ranks: what each one runs, and who starts them.

A rank's body (`run_rank`) is the same wherever it lives: join the TP group, build its
ModelRunner and extension, report ready, then run every batch or RankCommand the driver posts
until the driver posts SHUTDOWN. A `RankLauncher` decides where that body runs:
`SpawnLauncher` (default) starts local processes; deploy/ starts Ray actors in a placement group
so that every rank claims its own GPU and sits where the placement logic put it.
"""

from __future__ import annotations

import os
import queue
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.multiprocessing as mp

from engine import parallel
from engine.child_signals import ignore_terminal_signals, terminal_signals_blocked
from engine.config import EngineConfig
from engine.gc_tuning import freeze_startup_heap
from engine.model_runner import ModelRunner, runner_device
from engine.rank_device import bind_thread
from engine.step_queue import DriverWatch, StepQueue

SHUTDOWN = None  # posted to the ranks to make them leave their loop

RankExtension = Callable[[ModelRunner], Any]
E = TypeVar("E")
R = TypeVar("R")


class RankCommand(Generic[E, R]):
    """Work for the rank extension `E` of every TP rank, posted like a batch: a picklable
    dataclass whose `run(extension)` calls the extension's method itself, so both ends are typed
    (no method name travels as a string). Subclasses: the KV connectors' commands."""

    def run(self, extension: E) -> R:
        raise NotImplementedError


@dataclass(frozen=True)
class RankSpec:
    """Everything a non-driver rank needs to join its group (picklable)."""

    config: EngineConfig
    tp_rank: int
    tp_size: int
    master_addr: str
    master_port: int
    timeout_s: float
    rank_extension: RankExtension | None = None


def run_worker_loop(runner: ModelRunner, extension: Any = None) -> None:
    """A non-driver TP rank: run every batch (or RankCommand) the driver posts, until SHUTDOWN.
    Between steps it waits with no deadline (see engine/step_queue.py)."""
    steps = StepQueue(parallel.tp_store(), parallel.tp_rank(), parallel.tp_size())
    while True:
        message = steps.take()
        if message is SHUTDOWN:
            return
        if isinstance(message, RankCommand):
            message.run(extension)
        else:
            runner.execute(message)


def run_rank(spec: RankSpec, report: Callable[[str, int, str], None]) -> None:
    """The whole life of a non-driver rank; `report(state, rank, detail)` says ready or error."""
    torch.set_num_threads(spec.config.num_threads or 1)
    try:
        # Before the group forms: NCCL binds its communicator to the thread's current device.
        bind_thread(runner_device(spec.config, spec.tp_rank))
        parallel.init_tp_group(
            spec.tp_rank,
            spec.tp_size,
            spec.master_port,
            spec.config.device,
            spec.timeout_s,
            master_addr=spec.master_addr,
            op_timeout_s=spec.config.tp_timeout_s,
        )
        watch = DriverWatch(parallel.tp_store())
        runner = ModelRunner(spec.config, spec.tp_rank, spec.tp_size)
        extension = spec.rank_extension(runner) if spec.rank_extension is not None else None
    except BaseException:
        report("error", spec.tp_rank, traceback.format_exc())
        raise
    freeze_startup_heap()
    report("ready", spec.tp_rank, "")
    try:
        run_worker_loop(runner, extension)
    finally:
        watch.stop()
        parallel.destroy_tp_group()


class RankLauncher(Protocol):
    """Starts ranks 1..n-1 and watches them. Every wait is bounded."""

    def start(self, specs: list[RankSpec]) -> None: ...

    def wait_ready(self, timeout_s: float) -> None:
        """Return once every rank reported ready; raise RuntimeError naming what failed."""
        ...

    def dead(self) -> list[str]:
        """A description of every rank that is no longer alive (empty when all are)."""
        ...

    def pids(self) -> list[int]: ...

    def stop(self, join_timeout_s: float) -> None:
        """After the driver broadcast SHUTDOWN (or gave up): make sure no rank is left."""
        ...


def _spawned_rank_main(spec: RankSpec, status: Any) -> None:
    ignore_terminal_signals()  # the driver stops this rank; its death ends it (DriverWatch)
    code = 0
    try:
        run_rank(spec, lambda state, rank, detail: status.put((state, rank, detail)))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # Leave without the interpreter's teardown: with torch and transformers loaded it costs
        # seconds of CPU per rank, and the driver waits for it. Flush the reports first.
        status.close()
        status.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class SpawnLauncher:
    """Ranks as local processes (multiprocessing, spawn context)."""

    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []
        self._status: Any = None

    def start(self, specs: list[RankSpec]) -> None:
        context = mp.get_context("spawn")
        self._status = context.Queue()
        for spec in specs:
            proc = context.Process(
                target=_spawned_rank_main,
                args=(spec, self._status),
                name=f"pdserve-tp-rank-{spec.tp_rank}",
                daemon=True,
            )
            with terminal_signals_blocked():
                proc.start()
            self.processes.append(proc)

    def wait_ready(self, timeout_s: float) -> None:
        for _ in self.processes:
            try:
                state, rank, detail = self._status.get(timeout=timeout_s)
            except queue.Empty:
                dead = self.dead()
                raise RuntimeError(
                    f"TP ranks not ready within {timeout_s:.0f}s; "
                    + (f"dead: {', '.join(dead)}" if dead else "all spawned ranks still alive")
                ) from None
            if state != "ready":
                raise RuntimeError(f"TP rank {rank} failed to start:\n{detail}")
        # Done with the queue: free its semaphores now. A driver ends with os._exit, which runs
        # no finalizer, so they would stay in /dev/shm until the resource tracker's exit (three
        # per driver start: a restarted instance added three more each time).
        self._status.close()
        self._status.join_thread()
        self._status = None

    def dead(self) -> list[str]:
        return [
            f"TP rank {rank} (exit code {proc.exitcode})"
            for rank, proc in enumerate(self.processes, start=1)
            if not proc.is_alive()
        ]

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.processes if proc.pid is not None]

    def stop(self, join_timeout_s: float) -> None:
        for proc in self.processes:
            proc.join(join_timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(join_timeout_s)
        self.processes = []
