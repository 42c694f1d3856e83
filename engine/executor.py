"""The one object the engine talks to for model execution, at any TP size.

TP=1: the ModelRunner runs in the caller's process. TP>1: the caller's process is TP rank 0 (the
driver); ranks 1..n-1 are spawned processes running `run_worker_loop`. Each step the driver
broadcasts the ScheduledBatch over the gloo control group; every rank runs the same forward (the
TP collectives pair up inside it) and the driver returns its full-vocab logits.

Failure handling: startup waits are bounded by `timeout_s`; a rank that dies turns the next (or
current) step into a RuntimeError naming it, never a hang (gloo collectives also time out after
`timeout_s`). `shutdown()` is idempotent and also runs on garbage collection and at exit.

A process that is itself a TP rank (a prefill/decode worker rank) builds its runner directly:
`init_tp_group(rank, size, port, device)` then `ModelRunner(config, rank, size)`.

Workers add per-rank behaviour (the prefill side's KV sender) with `rank_extension`: a picklable
factory called on every rank with that rank's runner; `collective_call(method, ...)` then runs the
extension's method on every rank, in step order with the batches, and returns the driver's result.
"""

from __future__ import annotations

import queue
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from engine import parallel
from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.net import free_port

_SHUTDOWN = None  # broadcast to the workers to make them leave their loop

RankExtension = Callable[[ModelRunner], Any]


@dataclass
class RankCall:
    """Run `extension.<method>(*args, **kwargs)` on every TP rank (broadcast like a batch)."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def apply(self, extension: Any) -> Any:
        if extension is None:
            raise RuntimeError(f"rank call {self.method!r} needs a rank_extension")
        return getattr(extension, self.method)(*self.args, **self.kwargs)


def run_worker_loop(runner: ModelRunner, extension: Any = None) -> None:
    """A non-driver TP rank: run every batch (or RankCall) the driver broadcasts, until None."""
    while True:
        message = parallel.tp_broadcast_object(None)
        if message is _SHUTDOWN:
            return
        if isinstance(message, RankCall):
            message.apply(extension)
        else:
            runner.execute(message)


def _worker_main(
    config: EngineConfig, tp_rank: int, tp_size: int, port: int, status: Any, timeout_s: float,
    rank_extension: RankExtension | None,
) -> None:
    torch.set_num_threads(config.num_threads or 1)
    try:
        parallel.init_tp_group(tp_rank, tp_size, port, config.device, timeout_s)
        runner = ModelRunner(config, tp_rank, tp_size)
        extension = rank_extension(runner) if rank_extension is not None else None
    except BaseException:
        status.put(("error", tp_rank, traceback.format_exc()))
        raise
    status.put(("ready", tp_rank, ""))
    try:
        run_worker_loop(runner, extension)
    finally:
        parallel.destroy_tp_group()


class _Workers:
    """The spawned ranks; kept apart from Executor so a finalizer can close them without it."""

    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []
        self.group_ready = False

    def dead(self) -> list[str]:
        return [
            f"TP rank {rank} (exit code {proc.exitcode})"
            for rank, proc in enumerate(self.processes, start=1)
            if not proc.is_alive()
        ]

    def close(self, join_timeout_s: float = 10.0) -> None:
        if self.group_ready and not self.dead():
            try:
                parallel.tp_broadcast_object(_SHUTDOWN)
            except RuntimeError:
                pass  # a rank died meanwhile; it is killed below
        for proc in self.processes:
            proc.join(join_timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(join_timeout_s)
        self.processes = []
        if self.group_ready:
            parallel.destroy_tp_group()
            self.group_ready = False


class Executor:
    """Runs the model over `config.tensor_parallel_size` ranks; the caller's process is rank 0.

    Attributes: `model_config`, `num_kv_blocks`, `block_size`, `kv_cache` (the driver rank's).
    """

    def __init__(
        self, config: EngineConfig, timeout_s: float = 120.0,
        rank_extension: RankExtension | None = None,
    ) -> None:
        self.config = config
        self._rank_extension = rank_extension
        self.tp_size = config.tensor_parallel_size
        self._workers = _Workers()
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
        return [proc.pid for proc in self._workers.processes if proc.pid is not None]

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [batch.num_sampled, vocab_size] (float32; float64 for float64 models)."""
        return self._on_all_ranks(batch, lambda: self._runner.execute(batch))

    def collective_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`rank_extension(runner).<method>(*args, **kwargs)` on every rank; the driver's result."""
        call = RankCall(method, args, kwargs)
        return self._on_all_ranks(call, lambda: call.apply(self.extension))

    def _on_all_ranks(self, message: Any, run_here: Callable[[], Any]) -> Any:
        if self._broken is not None:
            raise RuntimeError(f"executor is unusable: {self._broken}")
        if not self._finalizer.alive:
            raise RuntimeError("executor was shut down")
        if self.tp_size == 1:
            return run_here()
        self._raise_if_dead()
        try:
            parallel.tp_broadcast_object(message)
            return run_here()
        except RuntimeError as exc:
            dead = self._workers.dead()
            self._broken = f"{', '.join(dead)} died" if dead else f"TP step failed: {exc}"
            raise RuntimeError(f"TP step failed: {self._broken}") from exc

    def shutdown(self) -> None:
        """Stop the worker ranks and leave the process group; safe to call more than once."""
        self._finalizer()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- startup
    def _start_workers(self, timeout_s: float) -> None:
        port = free_port()
        context = mp.get_context("spawn")
        self._status = context.Queue()
        for rank in range(1, self.tp_size):
            proc = context.Process(
                target=_worker_main,
                args=(
                    self.config, rank, self.tp_size, port, self._status, timeout_s,
                    self._rank_extension,
                ),
                name=f"pdserve-tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            self._workers.processes.append(proc)
        try:
            parallel.init_tp_group(0, self.tp_size, port, self.config.device, timeout_s)
        except Exception as exc:
            raise RuntimeError(
                f"TP group of {self.tp_size} ranks did not form within {timeout_s:.0f}s; "
                f"{self._failure_details()}"
            ) from exc
        self._workers.group_ready = True

    def _wait_ready(self, timeout_s: float) -> None:
        for _ in range(self.tp_size - 1):
            try:
                state, rank, detail = self._status.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(
                    f"TP ranks not ready within {timeout_s:.0f}s; {self._failure_details()}"
                ) from None
            if state != "ready":
                raise RuntimeError(f"TP rank {rank} failed to start:\n{detail}")

    def _failure_details(self) -> str:
        dead = self._workers.dead()
        return f"dead: {', '.join(dead)}" if dead else "all spawned ranks still alive"

    def _raise_if_dead(self) -> None:
        dead = self._workers.dead()
        if dead:
            self._broken = f"{', '.join(dead)} died"
            raise RuntimeError(f"TP step refused: {self._broken}")
