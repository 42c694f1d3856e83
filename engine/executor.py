"""The one object the engine talks to for model execution, at any TP size.

TP=1: the ModelRunner runs in the caller's process. TP>1: the caller's process is TP rank 0 (the
driver); ranks 1..n-1 run `engine.ranks.run_rank` wherever the `RankLauncher` puts them (local
processes by default, Ray actors under deploy/). Each step the driver
posts the ScheduledBatch to the other ranks (engine/step_queue.py: an idle rank waits for it with
no deadline); every rank runs the same forward (the TP collectives pair up inside it) and the
driver returns its full-vocab logits.

Failure handling: startup waits are bounded by `timeout_s`; a rank that dies turns the next (or
current) step into a RuntimeError naming it, never a hang (a collective waits at most
`config.tp_timeout_s` for its peers), and `check_ranks()` lets an idle owner notice it too.
`shutdown()` is idempotent and also runs on garbage collection and at exit.

A process that is itself a TP rank (a prefill/decode worker rank) builds its runner directly:
`init_tp_group(rank, size, port, device)` then `ModelRunner(config, rank, size)`.

Workers add per-rank behaviour (the prefill side's KV sender) with `rank_extension`: a picklable
factory called on every rank with that rank's runner; `run_on_ranks(command)` then runs a typed
RankCommand on every rank's extension, in step order with the batches, and returns the driver's
result.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from engine import parallel
from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, runner_device
from engine.net import free_port
from engine.rank_device import bind_thread
from engine.ranks import (
    SHUTDOWN,
    RankCommand,
    RankExtension,
    RankLauncher,
    RankSpec,
    SpawnLauncher,
    run_worker_loop,
)
from engine.step_queue import StepQueue

# How long a failed TP step waits to see whether a rank has exited (a SIGKILL closes its sockets
# before the kernel reports the exit); a failure with every rank alive is reported after it.
_DEATH_SEEN_S = 1.0

__all__ = ["Executor", "RankCommand", "RankExtension", "free_port", "run_worker_loop"]

R = TypeVar("R")


class _Ranks:
    """The launched ranks; kept apart from Executor so a finalizer can close them without it."""

    def __init__(self, launcher: RankLauncher) -> None:
        self.launcher = launcher
        self.group_ready = False
        self.steps: StepQueue | None = None

    def close(self, join_timeout_s: float = 10.0) -> None:
        if self.steps is not None and not self.launcher.dead():
            try:
                self.steps.post(SHUTDOWN)
            except RuntimeError:
                pass  # the store failed; the launcher kills the ranks below
        self.steps = None
        self.launcher.stop(join_timeout_s)
        if self.group_ready:
            parallel.destroy_tp_group()
            self.group_ready = False


class Executor:
    """Runs the model over `config.tensor_parallel_size` ranks; the caller's process is rank 0.

    Attributes: `model_config`, `num_kv_blocks`, `block_size`, `kv_cache` (the driver rank's).
    """

    def __init__(
        self,
        config: EngineConfig,
        timeout_s: float = 120.0,
        rank_extension: RankExtension | None = None,
        launcher: RankLauncher | None = None,
        master_addr: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self._rank_extension = rank_extension
        self.tp_size = config.tensor_parallel_size
        self.master_addr = master_addr
        self._workers = _Ranks(launcher if launcher is not None else SpawnLauncher())
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._broken: str | None = None
        try:
            if self.tp_size > 1:
                self._start_workers(timeout_s)
            else:
                parallel.set_tp_group(None, 0, 1)
            self._runner = ModelRunner(config, 0, self.tp_size)
            self.extension = rank_extension(self._runner) if rank_extension is not None else None
            if self.tp_size > 1:
                self._wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ public
    @property
    def model_config(self) -> ModelConfig:
        return self._runner.model_config

    @property
    def num_kv_blocks(self) -> int:
        return self._runner.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self._runner.block_size

    @property
    def kv_cache(self) -> KVCache:
        return self._runner.kv_cache

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the spawned TP ranks 1..n-1 (empty at TP=1 or after shutdown)."""
        return self._workers.launcher.pids() if self._finalizer.alive else []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [batch.num_logits, vocab_size] (float32; float64 for float64 models)."""
        return self._on_all_ranks(batch, lambda: self._runner.execute(batch))

    def run_on_ranks(self, command: RankCommand[Any, R]) -> R:
        """`command.run(extension)` on every rank, in step order; the driver's result."""
        return self._on_all_ranks(command, lambda: command.run(self.extension))

    def _on_all_ranks(self, message: Any, run_here: Callable[[], R]) -> R:
        if self._broken is not None:
            raise RuntimeError(f"executor is unusable: {self._broken}")
        if not self._finalizer.alive:
            raise RuntimeError("executor was shut down")
        if self.tp_size == 1:
            return run_here()
        self._raise_if_dead()
        assert self._workers.steps is not None
        try:
            self._workers.steps.post(message)
            return run_here()
        except RuntimeError as exc:
            dead = self._dead_within(_DEATH_SEEN_S)
            self._broken = f"{', '.join(dead)} died" if dead else f"TP step failed: {exc}"
            raise RuntimeError(f"TP step failed: {self._broken}") from exc

    def check_ranks(self) -> None:
        """Raise RuntimeError when a rank has died (or a step failed): the executor is then
        unusable for good, and its owner should report itself down so it is restarted."""
        if self._broken is not None:
            raise RuntimeError(f"executor is unusable: {self._broken}")
        if self.tp_size > 1 and self._finalizer.alive:
            self._raise_if_dead()

    def shutdown(self) -> None:
        """Stop the worker ranks and leave the process group; safe to call more than once."""
        self._finalizer()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- startup
    def _start_workers(self, timeout_s: float) -> None:
        port = free_port(self.master_addr)
        self._workers.launcher.start(
            [
                RankSpec(
                    self.config,
                    rank,
                    self.tp_size,
                    self.master_addr,
                    port,
                    timeout_s,
                    self._rank_extension,
                )
                for rank in range(1, self.tp_size)
            ]
        )
        try:
            bind_thread(runner_device(self.config, 0))  # NCCL binds to the current device
            parallel.init_tp_group(
                0,
                self.tp_size,
                port,
                self.config.device,
                timeout_s,
                master_addr=self.master_addr,
                op_timeout_s=self.config.tp_timeout_s,
            )
        except Exception as exc:
            dead = self._workers.launcher.dead()
            raise RuntimeError(
                f"TP group of {self.tp_size} ranks did not form within {timeout_s:.0f}s; "
                + (f"dead: {', '.join(dead)}" if dead else "all launched ranks still alive")
            ) from exc
        self._workers.group_ready = True
        self._workers.steps = StepQueue(parallel.tp_store(), 0, self.tp_size)

    def _wait_ready(self, timeout_s: float) -> None:
        self._workers.launcher.wait_ready(timeout_s)

    def lost_ranks(self) -> list[str]:
        """The TP ranks that have died, described (empty while all live, and for TP=1)."""
        return self._workers.launcher.dead() if self.tp_size > 1 else []

    def _dead_within(self, timeout_s: float) -> list[str]:
        """The dead ranks, waiting up to `timeout_s` for one: a killed rank's sockets close (and
        the step fails) a moment before its process can be seen to have exited."""
        deadline = time.monotonic() + timeout_s
        while not (dead := self._workers.launcher.dead()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead

    def _raise_if_dead(self) -> None:
        dead = self._workers.launcher.dead()
        if dead:
            self._broken = f"{', '.join(dead)} died"
            raise RuntimeError(f"TP step refused: {self._broken}")
