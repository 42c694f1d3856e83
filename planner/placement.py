"""Placements and how to simulate one: the objects the search ranks and the plan writes."""

from __future__ import annotations

from dataclasses import dataclass

from planner.latency import StepModel
from planner.profile import ModelProfile
from planner.sim_spec import InstanceSpec, LinkSpec, SimOptions, SimResult
from planner.simulator import Simulator
from planner.workload import Workload


@dataclass(frozen=True)
class Parallel:
    """One instance's parallelism and how many such instances."""

    tp: int = 1
    pp: int = 1
    count: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.count) < 1:
            raise ValueError(f"tp, pp and count must be >= 1, got {self}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} x{self.count}"


@dataclass(frozen=True)
class Placement:
    """A layout: disaggregated (prefill + decode) or colocated. `nodes_*` name the node of
    each instance (disaggregated); transfers between different nodes take the cross link."""

    layout: str  # "disaggregated" | "colocated"
    prefill: Parallel | None = None
    decode: Parallel | None = None
    colocated: Parallel | None = None
    prefill_nodes: tuple[int, ...] = ()
    decode_nodes: tuple[int, ...] = ()
    algorithm: str = ""

    def __post_init__(self) -> None:
        if self.layout == "colocated":
            if self.colocated is None:
                raise ValueError("a colocated placement needs `colocated`")
        elif self.layout == "disaggregated":
            if self.prefill is None or self.decode is None:
                raise ValueError("a disaggregated placement needs `prefill` and `decode`")
        else:
            raise ValueError(f"layout must be disaggregated or colocated, got {self.layout!r}")

    @property
    def num_gpus(self) -> int:
        if self.colocated is not None:
            return self.colocated.gpus * self.colocated.count
        assert self.prefill is not None and self.decode is not None
        return self.prefill.gpus * self.prefill.count + self.decode.gpus * self.decode.count

    def describe(self) -> str:
        if self.colocated is not None:
            return f"colocated {self.colocated.describe()}"
        assert self.prefill is not None and self.decode is not None
        return f"prefill {self.prefill.describe()}, decode {self.decode.describe()}"


def _instances(
    profile: ModelProfile, par: Parallel, nodes: tuple[int, ...], memory: bool
) -> list[InstanceSpec]:
    model = StepModel(profile.tp(par.tp), par.pp)
    capacity = profile.max_tokens(par.tp, par.pp) if memory else None
    return [
        InstanceSpec(model, par.tp, capacity, nodes[i] if i < len(nodes) else 0)
        for i in range(par.count)
    ]


def simulate(
    placement: Placement,
    profile: ModelProfile,
    workload: Workload,
    rate: float,
    *,
    link: LinkSpec | None = None,
    options: SimOptions | None = None,
    memory: bool = True,
    phase: str = "both",
) -> SimResult:
    """Run `workload` at `rate` req/s (whole cluster) through `placement`.

    `phase` = "prefill" or "decode" simulates that side alone (DistServe's Alg. 1)."""
    arrivals = workload.arrivals_ms(rate)
    prompts, outputs = list(workload.prompt_lens), list(workload.output_lens)
    if placement.colocated is not None:
        coloc = _instances(profile, placement.colocated, (), memory)
        return Simulator(prompts, outputs, arrivals, colocated=coloc, options=options).run()
    assert placement.prefill is not None and placement.decode is not None
    prefill = _instances(profile, placement.prefill, placement.prefill_nodes, memory)
    decode = _instances(profile, placement.decode, placement.decode_nodes, memory)
    return Simulator(
        prompts,
        outputs,
        arrivals,
        prefill=prefill if phase != "decode" else None,
        decode=decode if phase != "prefill" else None,
        link=link,
        options=options,
    ).run()
