"""The plain-process runtime's router handle: calls made over a pipe to a worker process."""

from __future__ import annotations

from typing import Any, TypeVar

from deploy.runtime.handle import HandleBase
from deploy.runtime.local.process_host import ProcessWorker
from worker.protocol import Role, WorkerCall

R = TypeVar("R")


class ProcessHandle(HandleBase):
    """A worker object in a child process (ProcessWorker)."""

    def __init__(self, instance_id: str, role: Role, worker: ProcessWorker, **kwargs: Any) -> None:
        super().__init__(instance_id, role, **kwargs)
        self.worker = worker

    def _invoke(self, command: WorkerCall[R], timeout_s: float) -> R:
        return self.worker.call(command, timeout_s)
