"""`rank_extension` + `collective_call`: per-rank behaviour that workers hang on the executor
(the prefill side's KV sender runs this way on every TP rank)."""

from __future__ import annotations

import pytest
import torch

from engine import parallel
from engine.config import EngineConfig
from engine.executor import Executor
from engine.model_runner import ModelRunner


class RankProbe:
    """Built on every rank; its methods run on every rank when the driver calls them."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_calls = 0

    def sum_of_ranks(self, offset: int) -> tuple[int, float]:
        # The all-reduce only completes if every rank runs this call: proof that followers did.
        self.num_calls += 1
        x = torch.tensor([float(parallel.tp_rank() + offset)], dtype=torch.float64)
        return self.num_calls, float(parallel.tp_all_reduce(x).item())

    def num_local_kv_heads(self) -> int:
        return self.runner.kv_cache.spec.num_kv_heads


@pytest.mark.parametrize("tp_size", [1, 2])
def test_collective_call_runs_on_every_rank(tiny_model, tp_size: int) -> None:
    config = EngineConfig(
        model_dir=tiny_model("llama"), dtype="float64", tensor_parallel_size=tp_size,
        num_kv_blocks=8, block_size=8,
    )
    with Executor(config, rank_extension=RankProbe) as executor:
        assert executor.collective_call("sum_of_ranks", 10) == (1, 10.0 * tp_size + (tp_size == 2))
        # calls interleave with batches in step order on every rank
        assert executor.collective_call("sum_of_ranks", offset=1) == (2, float(tp_size) + (tp_size == 2))
        assert executor.collective_call("num_local_kv_heads") == 2 // tp_size


def test_collective_call_without_extension_is_a_clear_error(tiny_model) -> None:
    config = EngineConfig(model_dir=tiny_model("llama"), dtype="float64", num_kv_blocks=8)
    with Executor(config) as executor, pytest.raises(RuntimeError, match="rank_extension"):
        executor.collective_call("anything")
