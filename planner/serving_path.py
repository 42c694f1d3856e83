"""The serving path's terms (`pdserve profile --path`, benchmarks/profiling/path.py) in the model.

An engine step is not all a worker's step costs, and a worker's core is not all its own:
  overhead       each step: the larger of the worker's extra CPU and its extra wall time at
                 batch 1 (the loop's waits); each sequence of a step: its token's way out (gRPC)
  ttft path      the hops to a first token (client -> router -> worker -> back), added to TTFT
  relay share    the router and the client are not pinned: at `rate` req/s, S emitting steps a
                 second, they need rate * (request + mean output * token) + S * step + idle ms
                 of CPU per second. The kernel wakes them on an idle core when there is one;
                 only what finds every core busy (chance P) comes off the instances, so every
                 step takes 1 / (1 - P * that CPU / cores) as long (Relay; S and P from a first
                 simulation pass). Measured under the chatbot load: the colocated workers, both
                 busy, lose 7.8% of their cores to it; the disaggregated decode worker loses
                 little, the relay running on the mostly idle prefill core.
  KV hand-off    (disaggregated) the channel's bandwidth and per-message time, the latency from
                 a first token to the decode loop beyond them, and what a request's KV costs
                 the sender's and the receiver's cores (measured_link)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.profile import ModelProfile, TPProfile
from planner.sim_spec import LinkSpec, SimOptions, SimResult

MAX_SHARE = 0.95  # past this the cores are the relay's: the run is saturated anyway


def apply_serving_path(profile: ModelProfile) -> ModelProfile:
    """Every TP entry with a measured serving path gets its per-step and per-sequence cost."""
    by_tp = {}
    for tp, entry in profile.by_tp.items():
        path = entry.serving_path
        if path:
            step = max(path.get("worker_step_ms", 0.0), path.get("worker_step_wall_ms", 0.0))
            entry = replace(
                entry, overhead=(step, 0.0), overhead_per_seq=path.get("worker_seq_ms", 0.0)
            )
        by_tp[tp] = entry
    return replace(profile, by_tp=by_tp)


def ttft_path_ms(profile: ModelProfile) -> float:
    return max(
        (e.serving_path.get("path_ttft_ms", 0.0) for e in profile.by_tp.values()), default=0.0
    )


@dataclass(frozen=True)
class Relay:
    """The router's and the client's CPU, ms: per request, per token, per worker step that
    emits tokens (one wake-up of the relay carries all of that step's tokens, so a token alone
    in its step costs ~5x a token among 24), and per second while idle (their polling)."""

    request_ms: float = 0.0
    token_ms: float = 0.0
    step_ms: float = 0.0
    idle_ms_per_s: float = 0.0

    def busy_cores(self, rate: float, mean_output: float, steps_per_s: float = 0.0) -> float:
        """Cores' worth of CPU at `rate` req/s with `steps_per_s` emitting steps a second."""
        per_s = rate * (self.request_ms + mean_output * self.token_ms)
        return (per_s + steps_per_s * self.step_ms + self.idle_ms_per_s) / 1e3


def relay_of(profile: ModelProfile) -> Relay:
    """The relay's costs from the TP=1 entry (or the first)."""
    entry = profile.by_tp.get(1) or next(iter(profile.by_tp.values()))
    path = entry.serving_path
    return Relay(
        path.get("relay_request_ms", 0.0),
        path.get("relay_token_ms", 0.0),
        path.get("relay_step_ms", 0.0),
        path.get("relay_idle_ms_per_s", 0.0),
    )


def relay_scale(
    relay: Relay,
    rate: float,
    mean_output: float,
    num_cores: int,
    steps_per_s: float = 0.0,
    all_busy: float = 1.0,
) -> float:
    """How much longer each step takes while the relay shares `num_cores` at `rate` req/s,
    `all_busy` the chance that it finds no core idle."""
    cores = relay.busy_cores(rate, mean_output, steps_per_s) * all_busy
    return 1.0 / (1.0 - min(cores / num_cores, MAX_SHARE))


def simulate_relayed(
    run: Callable[[SimOptions], SimResult],
    options: SimOptions,
    relay: Relay,
    rate: float,
    mean_output: float,
    num_cores: int,
) -> SimResult:
    """`run(options)` with the relay's share of the cores in `step_scale`. Its per-step cost
    needs the steps a second and what it takes off the instances needs how busy they are,
    which the simulation gives: a first pass that charges it all but its per-step cost, a
    second with the first's step rate and busy time."""
    if relay == Relay():
        return run(options)
    result = run(replace(options, step_scale=relay_scale(relay, rate, mean_output, num_cores)))
    if result.end_ms > 0:
        steps_per_s = result.num_steps / (result.end_ms / 1e3)
        scale = relay_scale(
            relay, rate, mean_output, num_cores, steps_per_s, result.all_busy(num_cores)
        )
        result = run(replace(options, step_scale=scale))
    return result


def measured_link(entry: TPProfile) -> LinkSpec | None:
    """The KV link `pdserve profile` measured (None without a measured channel): bandwidth and
    per-message time, and with `--path` the hand-off latency and each end's CPU per request."""
    kv = entry.kv_bytes_per_token
    if not (entry.transfer_GBps and kv):
        return None
    path = entry.serving_path
    return LinkSpec(
        kv,
        entry.transfer_GBps,
        entry.transfer_GBps,
        entry.transfer_per_message_ms,
        handoff_ms=path.get("handoff_ms", 0.0),
        send_cpu_ms=(path.get("kv_send_ms", 0.0), path.get("kv_send_ms_per_token", 0.0)),
        receive_cpu_ms=(path.get("kv_receive_ms", 0.0), path.get("kv_receive_ms_per_token", 0.0)),
    )
