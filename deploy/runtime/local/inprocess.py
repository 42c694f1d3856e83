"""A colocated worker inside the router's process, for tests, demos and single-process serving:
decode_worker.colocated.ColocatedWorker (LLMEngine on its own loop thread) behind the router's
handle interface."""

from __future__ import annotations

from decode_worker.colocated import ColocatedWorker
from deploy.runtime.local.handles import LocalHandle
from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.messages import Role


class InProcessColocatedHandle(LocalHandle):
    def __init__(
        self, instance_id: str, engine: LLMEngine | EngineConfig, max_waiting_requests: int = 256
    ) -> None:
        worker = ColocatedWorker(instance_id, engine, max_waiting_requests=max_waiting_requests)
        super().__init__(instance_id, Role.COLOCATED, worker)

    @property
    def engine(self) -> LLMEngine:
        return self.worker.engine
