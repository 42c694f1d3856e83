"""Router handles (router/worker_api.py) over worker objects, wherever those live: the base both
runtimes share.

A worker object (worker/instance.Worker) has blocking, thread-safe methods; each handle method
makes the matching typed call (worker/protocol.py: Submit, Reserve, Abort, Load, PollEvents).
The router's interface is async, so each call runs on a thread (`_executor`; None: the default
one) with its own timeout. `LocalHandle` runs the call on a worker in this process;
deploy/runtime/local/handles.ProcessHandle sends it to a worker process, and
deploy/runtime/ray/handles.RayHandle to a Ray actor.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, TypeVar

from kv_transfer.messages import KVTicket
from worker.protocol import (
    Abort,
    InstanceLoad,
    Load,
    PollEvents,
    PrefixReport,
    Reserve,
    Role,
    Submit,
    TokenEvent,
    Worker,
    WorkerCall,
    WorkerRequest,
)

R = TypeVar("R")


class HandleBase:
    """PrefillHandle / DecodeHandle / colocated handle; subclasses say how a call is made."""

    _executor: Executor | None = None

    def __init__(
        self,
        instance_id: str,
        role: Role,
        call_timeout_s: float = 10.0,
        prefill_tp_sizes: dict[str, int] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.role = role
        self.call_timeout_s = call_timeout_s
        # decode handles: the TP size of each prefill instance (the ticket's re-sharding plan)
        self.prefill_tp_sizes = prefill_tp_sizes or {}

    def _invoke(self, command: WorkerCall[R], timeout_s: float) -> R:
        raise NotImplementedError

    async def _call(self, command: WorkerCall[R], timeout_s: float | None = None) -> R:
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._invoke, command, timeout)

    async def load(self, prefix: PrefixReport = PrefixReport.NONE) -> InstanceLoad:
        return await self._call(Load(prefix))  # healthy=False from a worker whose loop failed

    async def abort(self, request_id: str) -> None:
        await self._call(Abort(request_id))

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        return await self._call(PollEvents(timeout_s), timeout_s + self.call_timeout_s)

    async def submit(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        await self._call(Submit(request, ticket))

    async def reserve(self, request: WorkerRequest) -> KVTicket:
        tp_size = self.prefill_tp_sizes.get(request.prefill_instance, 1)
        return await self._call(Reserve(request, request.prefill_instance, tp_size))


class LocalHandle(HandleBase):
    """A worker object in this process."""

    def __init__(self, instance_id: str, role: Role, worker: Worker, **kwargs: Any) -> None:
        super().__init__(instance_id, role, **kwargs)
        self.worker = worker

    def _invoke(self, command: WorkerCall[R], timeout_s: float) -> R:
        return command.run(self.worker)
