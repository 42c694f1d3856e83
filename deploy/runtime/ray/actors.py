"""The Ray actors of a pdserve cluster: one per worker instance (its TP rank 0).

    WorkerActor  "pdserve-prefill-0"  Worker (role PREFILL), rank 0 in bundle 0 (RankActors in 1..k-1)
    WorkerActor  "pdserve-decode-j"   Worker (role DECODE); likewise "pdserve-colocated-j",
                                      "pdserve-adaptive-j" for the other layouts

A WorkerActor is threaded (many concurrent calls: a long `poll_events` never blocks `submit` or
`abort`; the worker object serialises them on its own loop thread). Its constructor builds the
whole worker (model, KV pool, TP group), so "the actor is up" means "the worker is ready", and a
restart (Ray's max_restarts, after the process died, or after it exited because its worker loop
failed) builds a fresh worker behind the same name and handle. The router runs in the driver
process (deploy/runtime/router_host.py), with a RayHandle per worker actor.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from deploy.runtime.channels import form_decode_channels, settle_prefill_channels
from deploy.runtime.local.process_host import exit_when_failed
from deploy.runtime.ray.handles import ActorControl, actor_call
from deploy.runtime.ray.placement import InstancePlacement, core_set, pin_to_core_set
from engine.gc_tuning import freeze_startup_heap
from worker.protocol import WorkerCall

if TYPE_CHECKING:  # imported in the actor only: the driver needs neither torch nor the model code
    from deploy.config.cluster_spec import KVPeers
    from worker.config import WorkerConfig

R = TypeVar("R")


class WorkerActor:
    """An instance's driver process (TP rank 0), whatever its role."""

    def __init__(
        self,
        config: WorkerConfig,
        placement: InstancePlacement,
        num_workers: int,
        pin_cores: bool,
        namespace: str,
        rank_actor_names: list[str] | None = None,
        peers: KVPeers | None = None,
    ) -> None:
        import ray
        import torch

        from deploy.runtime.ray.launcher import RayRankLauncher
        from worker.instance import Worker

        if pin_cores:
            pin_to_core_set(core_set(placement.worker_indices[0], num_workers))
        torch.set_num_threads(config.engine.num_threads or 1)
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        if self.node_ip != config.kv_transfer.host and config.kv_transfer.host == "127.0.0.1":
            # decode ranks listen where prefill ranks on other nodes can reach them
            config = replace(config, kv_transfer=replace(config.kv_transfer, host=self.node_ip))
        # By name, not handle: handles in the arguments of a restartable actor pin objects.
        rank_actors = []
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:
            _kill_stale_ranks(rank_actor_names or [])
        else:
            rank_actors = [ray.get_actor(name) for name in rank_actor_names or []]
        launcher = None
        if placement.tp_size > 1:
            launcher = RayRankLauncher(placement, num_workers, pin_cores, rank_actors)
        self.instance_id = placement.instance_id
        self.worker = Worker(config, self.instance_id, ActorControl(namespace), launcher=launcher)
        self.worker.node = f"{self.node_ip}/{self.node_id[:8]}"  # one IP for simulated nodes
        if restarted and peers is not None:
            self._rejoin(placement, peers, namespace, config.kv_transfer.transfer_timeout_s + 5)
        # A worker whose loop died (say, a TP rank was killed) exits, so Ray restarts the actor;
        # alive but broken, it would report unhealthy for good.
        threading.Thread(target=exit_when_failed, args=(self.worker,), daemon=True).start()
        freeze_startup_heap()

    def call(self, command: WorkerCall[R]) -> R:
        """The worker's API (worker/protocol.py): every router and peer call is one command."""
        return command.run(self.worker)

    def _rejoin(
        self, placement: InstancePlacement, peers: KVPeers, namespace: str, timeout_s: float
    ) -> None:
        """A restarted actor forms its KV channels (deploy/runtime/channels.py) before the
        router uses it: those it receives on first, then those it sends on."""
        peer_call = actor_call(namespace, timeout_s)
        if peers.sources:
            failing = form_decode_channels(
                self.worker, self.instance_id, peers.sources, peer_call, timeout_s
            )
            if failing:
                print(f"{self.instance_id}: KV channels to {failing} did not form", flush=True)
        if not peers.targets:
            return
        # Acks (KVTransferDone) reach this actor only once its constructor returned: settle
        # the channels on a thread, reporting unhealthy (so the router avoids it) until then.
        self.worker.ready.clear()

        def settle() -> None:
            try:
                settle_prefill_channels(
                    self.call,
                    self.instance_id,
                    placement.tp_size,
                    list(peers.targets),
                    peer_call,
                    timeout_s,
                )
            finally:
                self.worker.ready.set()

        threading.Thread(target=settle, daemon=True).start()

    def info(self) -> dict[str, Any]:
        """Where this instance runs: node address and id, process ids (rank 0 first)."""
        return {"node_ip": self.node_ip, "node_id": self.node_id, "pids": self.worker.process_ids()}

    def shutdown(self) -> None:
        self.worker.shutdown()


def _kill_stale_ranks(names: list[str]) -> None:
    """The rank actors of a TP group whose driver died belong to that group: end those still
    alive. One may be gone already (its death is what failed the driver), so a name that no
    longer resolves is fine."""
    import ray

    for name in names:
        try:
            ray.kill(ray.get_actor(name), no_restart=True)
        except ValueError:  # a dead named actor no longer resolves
            pass
