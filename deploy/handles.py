"""Router handles for workers that live in other processes (deploy/process_host.ProcessWorker).

The router's interface is async (router/worker_api.py); a ProcessWorker call blocks, so each call
runs on a thread of the default executor with its own timeout. The worker objects themselves
(PrefillWorker, DecodeWorker, ColocatedWorker) expose the same method names as the handles.
"""

from __future__ import annotations

import asyncio
from typing import Any

from deploy.process_host import ProcessWorker
from engine.messages import InstanceLoad, Role, TokenEvent, WorkerRequest


class ProcessHandle:
    """PrefillHandle / DecodeHandle / colocated handle over a ProcessWorker."""

    def __init__(
        self, instance_id: str, role: Role, worker: ProcessWorker, call_timeout_s: float = 10.0,
        prefill_tp_sizes: dict[str, int] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.role = role
        self.worker = worker
        self.call_timeout_s = call_timeout_s
        # decode handles: the TP size of each prefill instance (the ticket's re-sharding plan)
        self.prefill_tp_sizes = prefill_tp_sizes or {}

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        return await asyncio.to_thread(self.worker.call, method, *args, timeout_s=timeout)

    async def load(self) -> InstanceLoad:
        load: InstanceLoad = await self._call("load")
        if not self.worker.is_alive():
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

    async def close(self) -> None:
        await asyncio.to_thread(self.worker.shutdown)
