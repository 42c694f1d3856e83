"""Router handles (router/worker_api.py) over worker objects, wherever those live.

A worker object (PrefillWorker, DecodeWorker, ColocatedWorker) has blocking, thread-safe methods
with the same names as the handle's. The router's interface is async, so each call runs on a
thread of the default executor with its own timeout. `LocalHandle` calls a worker in this
process; `ProcessHandle` calls one hosted by deploy/process_host.ProcessWorker.
"""

from __future__ import annotations

import asyncio
from typing import Any

from deploy.runtime.local.process_host import ProcessWorker
from engine.messages import InstanceLoad, Role, TokenEvent, WorkerRequest


class HandleBase:
    """PrefillHandle / DecodeHandle / colocated handle; subclasses say how a call is made."""

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

    def _invoke(self, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        raise NotImplementedError

    def _alive(self) -> bool:
        return True

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        return await asyncio.to_thread(self._invoke, method, args, timeout)

    async def load(self) -> InstanceLoad:
        load: InstanceLoad = await self._call("load")
        if not self._alive():
            load.healthy = False
        return load

    async def abort(self, request_id: str) -> None:
        await self._call("abort", request_id)

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        events: list[TokenEvent] = await self._call(
            "poll_events", timeout_s, timeout_s=timeout_s + self.call_timeout_s
        )
        return events

    async def submit(self, request: WorkerRequest, ticket: object | None) -> None:
        await self._call("submit", request, ticket)

    async def reserve(self, request: WorkerRequest) -> object:
        tp_size = self.prefill_tp_sizes.get(request.prefill_instance, 1)
        return await self._call("reserve", request, request.prefill_instance, tp_size)


class LocalHandle(HandleBase):
    """A worker object in this process."""

    def __init__(self, instance_id: str, role: Role, worker: Any, **kwargs: Any) -> None:
        super().__init__(instance_id, role, **kwargs)
        self.worker = worker

    def _invoke(self, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        return getattr(self.worker, method)(*args)

    def _alive(self) -> bool:
        return bool(getattr(self.worker, "healthy", True))

    async def close(self) -> None:
        await asyncio.to_thread(self.worker.shutdown)


class ProcessHandle(HandleBase):
    """A worker object in a child process (ProcessWorker)."""

    def __init__(self, instance_id: str, role: Role, worker: ProcessWorker, **kwargs: Any) -> None:
        super().__init__(instance_id, role, **kwargs)
        self.worker = worker

    def _invoke(self, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        return self.worker.call(method, *args, timeout_s=timeout_s)

    def _alive(self) -> bool:
        return self.worker.is_alive()

    async def close(self) -> None:
        await asyncio.to_thread(self.worker.shutdown)
