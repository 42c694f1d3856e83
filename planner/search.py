"""DistServe's placement search (its Alg. 1 and Alg. 2), the colocated layout, and the plan.

Every candidate gets a binary search on its per-GPU rate: the highest rate whose simulated run
still meets the SLOs (as DistServe's simulator searches). A candidate first runs at the best
rate found so far and is dropped at once when it fails there, which keeps the search short.

Alg. 1 (high node affinity: a fast cross-node network) sizes each phase alone: the best
(tp, pp) of a prefill instance by its per-GPU rate under the TTFT SLO, the same for decode
under the TPOT SLO, then the replica counts that balance the two within the cluster; the few
best combinations are then simulated whole, transfer included, and the best one kept.
Alg. 2 (low affinity) keeps a prefill and a decode instance in the same node segment, so
their KV moves over NVLink; a segment may be pipelined over `pp_cross` nodes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import product

from planner.attainment import joint_attainment, separate_ok
from planner.placement import Parallel, Placement, simulate
from planner.profile import ModelProfile
from planner.serving_path import Relay, simulate_relayed
from planner.sim_spec import LinkSpec, SimOptions, SimResult
from planner.workload import Workload


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float
    attainment: float = 0.9
    # "joint": the benchmark's attainment (both SLOs met by >= attainment of the requests);
    # "separate": DistServe's simulator (each latency's percentile under its SLO).
    criterion: str = "joint"

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0 or not 0 < self.attainment <= 1:
            raise ValueError("SLOs must be > 0 and the attainment target in (0, 1]")
        if self.criterion not in ("joint", "separate"):
            raise ValueError("criterion must be joint or separate")

    def met(self, result: SimResult, phase: str = "both") -> bool:
        ttft = self.ttft_ms if phase != "decode" else math.inf
        tpot = self.tpot_ms if phase != "prefill" else math.inf
        if self.criterion == "separate":
            return separate_ok(result, ttft, tpot, 100 * self.attainment)
        return joint_attainment(result, ttft, tpot) >= self.attainment


@dataclass(frozen=True)
class Cluster:
    num_nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("a cluster needs >= 1 node and >= 1 GPU per node")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class SearchSettings:
    max_per_gpu_rate: float = 16.0
    eps: float = 0.02  # stop when hi - lo < eps * max(lo, 0.1)
    absolute_eps: float | None = None  # DistServe's rule (hi - lo < 0.25) when set
    memory: bool = True
    link: LinkSpec | None = None
    options: SimOptions = field(default_factory=SimOptions)
    alg1_candidates: int = 3
    pp_choices: tuple[int, ...] = (1, 2, 4, 8)
    # Drop a candidate that fails at the best rate so far. DistServe bisects each candidate
    # from [0, max] whole; pruning starts at another point and so ends on another grid.
    prune: bool = True
    # Router + client CPU sharing the instances' cores (planner/serving_path.py); all zero:
    # they have cores of their own.
    relay: Relay = field(default_factory=Relay)
    # The colocated layout as replicas filling the cluster (False: one instance, as DistServe).
    colocated_fill: bool = False


@dataclass
class Scored:
    placement: Placement
    per_gpu_rate: float


@dataclass
class Plan:
    best: Scored
    best_disaggregated: Scored | None
    best_colocated: Scored | None
    candidates: list[Scored]
    search_s: float

    @property
    def winner_ratio(self) -> float:
        """Best disaggregated per-GPU goodput over the best colocated (inf with no colocated)."""
        if not self.best_colocated or self.best_colocated.per_gpu_rate == 0:
            return math.inf
        dis = self.best_disaggregated.per_gpu_rate if self.best_disaggregated else 0.0
        return dis / self.best_colocated.per_gpu_rate


def max_per_gpu_rate(
    passes: Callable[[float], bool], hi: float, settings: SearchSettings, floor: float = 0.0
) -> float:
    """Largest per-GPU rate in (0, hi] that passes, by bisection; 0 when none does.

    With `floor` > 0, a candidate that fails at `floor` returns 0 at once (it cannot win).
    """
    lo = 0.0
    if floor > 0:
        if not passes(floor):
            return 0.0
        lo = floor
    while True:
        width = hi - lo
        if settings.absolute_eps is not None:
            if width <= settings.absolute_eps:  # DistServe: while hi - lo > esp
                return lo
        elif width < settings.eps * max(lo, 0.1):
            return lo
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid


def _runnable(profile: ModelProfile, tp: int, pp: int) -> bool:
    return profile.runnable(tp, pp)


def _score(
    placement: Placement,
    profile: ModelProfile,
    workload: Workload,
    slo: SLO,
    settings: SearchSettings,
    floor: float,
    phase: str = "both",
) -> float:
    gpus = placement.num_gpus
    mean_output = sum(workload.output_lens) / len(workload)

    def passes(per_gpu: float) -> bool:
        def run(options: SimOptions) -> SimResult:
            return simulate(
                placement,
                profile,
                workload,
                per_gpu * gpus,
                link=settings.link,
                options=options,
                memory=settings.memory,
                phase=phase,
            )

        result = simulate_relayed(
            run, settings.options, settings.relay, per_gpu * gpus, mean_output, gpus
        )
        return slo.met(result, phase)

    return max_per_gpu_rate(
        passes, settings.max_per_gpu_rate, settings, floor if settings.prune else 0.0
    )


def search_colocated(
    profile: ModelProfile,
    workload: Workload,
    slo: SLO,
    cluster: Cluster,
    settings: SearchSettings,
) -> list[Scored]:
    """One colocated instance per (tp, pp) that fits the cluster, as DistServe's vLLM search.
    The chunked policy (our colocated worker) has no pipeline: it tries pp = 1 only."""
    scored: list[Scored] = []
    best = 0.0
    pps = settings.pp_choices if settings.options.colocated_policy != "chunked" else (1,)
    for tp, pp in product(sorted(profile.by_tp), pps):
        if tp * pp > cluster.num_gpus or not _runnable(profile, tp, pp):
            continue
        count = cluster.num_gpus // (tp * pp) if settings.colocated_fill else 1
        placement = Placement("colocated", colocated=Parallel(tp, pp, count), algorithm="colocated")
        rate = _score(placement, profile, workload, slo, settings, best)
        scored.append(Scored(placement, rate))
        best = max(best, rate)
    return scored


def search_low_affinity(
    profile: ModelProfile,
    workload: Workload,
    slo: SLO,
    cluster: Cluster,
    settings: SearchSettings,
) -> list[Scored]:
    """Alg. 2: a prefill and a decode instance share each node segment (KV over NVLink)."""
    tps = [t for t in sorted(profile.by_tp) if t <= cluster.gpus_per_node]
    pps = [p for p in settings.pp_choices if p <= cluster.gpus_per_node]
    crosses = [c for c in settings.pp_choices if c <= cluster.num_nodes]
    scored: list[Scored] = []
    best = 0.0
    for cross, tp_p, pp_p, tp_d, pp_d in product(crosses, tps, pps, tps, pps):
        if tp_p * pp_p + tp_d * pp_d > cluster.gpus_per_node:
            continue
        if not (_runnable(profile, tp_p, cross * pp_p) and _runnable(profile, tp_d, cross * pp_d)):
            continue
        placement = Placement(
            "disaggregated",
            Parallel(tp_p, cross * pp_p),
            Parallel(tp_d, cross * pp_d),
            prefill_nodes=(0,),
            decode_nodes=(0,),
            algorithm="low-affinity",
        )
        rate = _score(placement, profile, workload, slo, settings, best)
        scored.append(Scored(placement, rate))
        best = max(best, rate)
    return scored


def _phase_best(
    profile: ModelProfile,
    workload: Workload,
    slo: SLO,
    cluster: Cluster,
    settings: SearchSettings,
    phase: str,
) -> list[tuple[Parallel, float]]:
    """(instance parallelism, goodput per instance in req/s) of one phase simulated alone."""
    out = []
    for tp, pp in product(sorted(profile.by_tp), settings.pp_choices):
        if tp * pp > cluster.num_gpus or not _runnable(profile, tp, pp):
            continue
        one = Parallel(tp, pp)
        placement = Placement("disaggregated", one, one, algorithm="high-affinity")
        # The rate is per GPU of the pair; only one side runs, so x num_gpus is its own rate.
        per_gpu = _score(placement, profile, workload, slo, settings, 0.0, phase)
        out.append((one, per_gpu * placement.num_gpus))
    return out


def _pack_nodes(cluster: Cluster, sizes: list[int]) -> list[int]:
    """Node of each instance, filled in order (an instance larger than a node spans several)."""
    nodes, node, used = [], 0, 0
    for size in sizes:
        if used + size > cluster.gpus_per_node and used > 0:
            node, used = node + 1, 0
        nodes.append(node)
        used += size
        while used >= cluster.gpus_per_node:
            node, used = node + 1, used - cluster.gpus_per_node
    return nodes


def search_high_affinity(
    profile: ModelProfile,
    workload: Workload,
    slo: SLO,
    cluster: Cluster,
    settings: SearchSettings,
) -> list[Scored]:
    """Alg. 1: the best instance of each phase alone, replicated to balance the two, then the
    best combinations simulated whole (with the transfer between their nodes)."""
    pre = _phase_best(profile, workload, slo, cluster, settings, "prefill")
    dec = _phase_best(profile, workload, slo, cluster, settings, "decode")
    combos = []
    for (p, gp), (d, gd) in product(pre, dec):
        if gp <= 0 or gd <= 0:
            continue
        for n in range(1, cluster.num_gpus // p.gpus + 1):
            m = max(1, math.ceil(n * gp / gd))
            if n * p.gpus + m * d.gpus > cluster.num_gpus:
                break
            rate = min(n * gp, m * gd) / (n * p.gpus + m * d.gpus)
            combos.append((rate, n * p.gpus + m * d.gpus, replace(p, count=n), replace(d, count=m)))
    combos.sort(key=lambda c: (-c[0], c[1]))
    scored: list[Scored] = []
    best = 0.0
    seen = set()
    for _, _, p, d in combos:
        if len(scored) >= settings.alg1_candidates:
            break
        key = (p.tp, p.pp, d.tp, d.pp, p.count, d.count)
        if key in seen:
            continue
        seen.add(key)
        nodes = _pack_nodes(cluster, [p.gpus] * p.count + [d.gpus] * d.count)
        placement = Placement(
            "disaggregated",
            p,
            d,
            prefill_nodes=tuple(nodes[: p.count]),
            decode_nodes=tuple(nodes[p.count :]),
            algorithm="high-affinity",
        )
        rate = _score(placement, profile, workload, slo, settings, 0.0)
        scored.append(Scored(placement, rate))
        best = max(best, rate)
    return scored


def plan(
    profile: ModelProfile,
    workload: Workload,
    slo: SLO,
    cluster: Cluster,
    settings: SearchSettings | None = None,
    *,
    algorithms: tuple[str, ...] = ("low", "high"),
    colocated_profile: ModelProfile | None = None,
) -> Plan:
    """Search the chosen algorithms and the colocated layout; the best per-GPU goodput wins."""
    settings = settings or SearchSettings()
    started = time.perf_counter()
    disagg: list[Scored] = []
    if "low" in algorithms:
        disagg += search_low_affinity(profile, workload, slo, cluster, settings)
    if "high" in algorithms:
        disagg += search_high_affinity(profile, workload, slo, cluster, settings)
    coloc = search_colocated(colocated_profile or profile, workload, slo, cluster, settings)
    best_d = _best(disagg)
    best_c = _best(coloc)
    everything = disagg + coloc
    best = _best(everything)
    if best is None:
        raise ValueError("no placement is runnable on this cluster with this profile")
    return Plan(best, best_d, best_c, everything, time.perf_counter() - started)


def _best(scored: list[Scored]) -> Scored | None:
    """Highest per-GPU rate; ties go to fewer GPUs (DistServe's find_best_config)."""
    if not scored:
        return None
    return min(scored, key=lambda s: (-s.per_gpu_rate, s.placement.num_gpus))
