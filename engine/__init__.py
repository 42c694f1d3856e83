"""pdserve's model runtime: what the prefill, decode and colocated workers all run.

    from engine import LLM, SamplingParams
    with LLM(model_dir, dtype="float32") as llm:
        outputs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16))

Names are imported lazily (PEP 562), so `import engine.block_pool` (the
router, kv_transfer) does not pull in torch models and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "StepOutput": "engine.outputs",
    "SchedulerStats": "engine.outputs",
    "Scheduler": "engine.scheduler",
    "Sampler": "engine.sampler",
    "Executor": "engine.executor",
    "BlockPool": "engine.block_pool",
    "Request": "engine.request",
    "RequestStatus": "engine.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
