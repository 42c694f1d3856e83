"""`rank_extension` + `run_on_ranks`: per-rank behaviour that workers hang on the executor (the
KV connectors' rank sides run this way on every TP rank), reached by typed RankCommands."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine import parallel
from engine.config import EngineConfig
from engine.executor import Executor
from engine.model_runner import ModelRunner
from engine.ranks import RankCommand


class RankProbe:
    """Built on every rank; its methods run on every rank when the driver posts a command."""

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


@dataclass(frozen=True)
class SumOfRanks(RankCommand[RankProbe, tuple[int, float]]):
    offset: int

    def run(self, extension: RankProbe) -> tuple[int, float]:
        return extension.sum_of_ranks(self.offset)


class NumLocalKVHeads(RankCommand[RankProbe, int]):
    def run(self, extension: RankProbe) -> int:
        return extension.num_local_kv_heads()


# tp_size 2 starts a rank process: the slow tier's
@pytest.mark.parametrize("tp_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_run_on_ranks_runs_on_every_rank(tiny_model, tp_size: int) -> None:
    config = EngineConfig(
        model_dir=tiny_model("llama"),
        dtype="float64",
        tensor_parallel_size=tp_size,
        num_kv_blocks=8,
        block_size=8,
    )
    with Executor(config, rank_extension=RankProbe) as executor:
        assert executor.run_on_ranks(SumOfRanks(10)) == (1, 10.0 * tp_size + (tp_size == 2))
        # commands interleave with batches in step order on every rank
        assert executor.run_on_ranks(SumOfRanks(1)) == (2, float(tp_size) + (tp_size == 2))
        assert executor.run_on_ranks(NumLocalKVHeads()) == 2 // tp_size
