"""A TP rank takes the GPU its runtime gave it: the choice as a pure function of what the
process sees, and a real Ray actor given one (declared) GPU, which sees it as device 0."""

from __future__ import annotations

import os

import pytest

from engine.rank_device import cuda_index


@pytest.mark.parametrize(
    "tp_rank,count,visible,ray_ids,expected",
    [
        (1, 1, ["3"], ["3"], 0),  # Ray actor, one GPU made visible: it is device 0
        (0, 1, ["3"], ["3"], 0),
        (1, 4, None, ["2"], 2),  # Ray left every GPU visible: its id is the ordinal
        (1, 2, ["6", "2"], ["2"], 1),  # the given GPU among several visible ones
        (1, 2, ["4", "5"], [], 1),  # local runtime: k GPUs per worker, rank r takes cuda:r
        (0, 2, ["4", "5"], [], 0),
        (1, 1, ["0"], [], 0),  # local runtime, one GPU shared by every process
        (3, 8, None, [], 3),
    ],
)
def test_rank_takes_the_gpu_its_runtime_gave_it(
    tp_rank: int, count: int, visible: list[str] | None, ray_ids: list[str], expected: int
) -> None:
    assert cuda_index(tp_rank, count, visible, ray_ids) == expected


def test_a_rank_without_a_gpu_of_its_own_is_refused_with_the_reason() -> None:
    with pytest.raises(RuntimeError, match="TP rank 2 needs its own GPU.*sees 2"):
        cuda_index(2, 2, ["0", "1"], [])
    with pytest.raises(RuntimeError, match="sees no GPU"):
        cuda_index(0, 0, [], [])


@pytest.mark.slow
def test_a_ray_actor_given_one_gpu_picks_device_0() -> None:
    """Two actors with num_gpus=1 on a node that declares two GPUs: Ray gives each its own id and
    shows it only that one (CUDA_VISIBLE_DEVICES); rank 1 must not pick cuda:1."""
    import ray

    from deploy.runtime.ray.node import start_local_ray

    @ray.remote(num_gpus=1, num_cpus=0)
    class Rank:
        def choice(self, tp_rank: int) -> tuple[list[str], str | None, int]:
            from engine.rank_device import _ray_gpu_ids, cuda_index

            names = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible = None if names is None else names.split(",")
            ids = _ray_gpu_ids()
            count = len(visible) if visible is not None else 2  # what CUDA would report
            return ids, names, cuda_index(tp_rank, count, visible, ids)

    node = start_local_ray("device-choice", num_cpus=1, num_gpus=2)
    try:
        ranks = [Rank.remote() for _ in range(2)]  # type: ignore[attr-defined]
        choices = ray.get([rank.choice.remote(i) for i, rank in enumerate(ranks)], timeout=120)
    finally:
        survivors = node.stop()
    assert survivors == []
    ids = sorted(choice[0][0] for choice in choices)
    assert ids == ["0", "1"], choices  # each actor its own GPU
    for gpu_ids, visible, index in choices:
        assert visible == gpu_ids[0] and index == 0, choices


def test_ray_ranks_share_gpus_only_over_the_same_node_transport_at_tp1() -> None:
    from deploy.runtime.ray.placement import gpus_per_rank

    assert gpus_per_rank("auto", [1, 1, 1], 1.0) == 0.33  # one GPU, the default layout
    assert gpus_per_rank("same_node", [1, 1, 1, 1], 2.0) == 0.5
    assert gpus_per_rank("network", [1, 1, 1], 1.0) == 1.0  # NCCL: one rank per GPU
    assert gpus_per_rank("auto", [2, 1], 1.0) == 1.0  # a TP group needs GPUs of its own
    assert gpus_per_rank("auto", [1, 1], 4.0) == 1.0  # enough GPUs: one each
