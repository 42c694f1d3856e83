"""The router's handles over worker actors, and the workers' control path to each other.

`RayHandle` is the PrefillHandle / DecodeHandle of router/worker_api.py over a worker actor
(deploy/ray_actors.WorkerActor): each method is one typed call (worker/protocol.py) sent to the
actor's `call`, made and waited for (with its own timeout) on a thread, and awaited from the
router's event loop. Failures map onto what the router understands:

    the actor died / is restarting / did not answer in time  -> WorkerUnavailable
    the worker raised (Overloaded, ValueError, ...)           -> that same exception, unwrapped

A restarted actor (Ray's max_restarts) keeps its name and its handle, so the same RayHandle
reaches it again; after an error the handle also looks the actor up by name again, which covers
an actor that someone re-created under the same name.

`ActorControl` is the `send_control(instance_id, message)` every worker is built with
(KVTransferDone decode -> prefill, KVAbort either way): a fire-and-forget Deliver call on the
named peer actor. Only these small messages travel through Ray; KV travels over the
kv_transfer channels.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from deploy.runtime.channels import PeerCall
from deploy.runtime.handle import HandleBase
from worker.protocol import Deliver, Role, WorkerCall, WorkerUnavailable

# Actor calls run on these threads, submission and result alike, as ProcessHandle's pipe calls
# do. Made on the router's event loop, submitting them and unpickling their results (poll_events'
# token events) left the loop too busy to accept new gRPC calls faster than it finished old ones:
# under a burst the excess waited inside gRPC core, where admission never sees a call, instead
# of being refused. Enough threads for every instance's long poll plus a burst's calls.
_CALLS = ThreadPoolExecutor(64, thread_name_prefix="ray-call")
R = TypeVar("R")


def actor_name(instance_id: str) -> str:
    return f"pdserve-{instance_id}"


def actor_call(namespace: str, timeout_s: float) -> PeerCall:
    """A typed call on the worker actor of an instance, by name, waited for (deploy/runtime/
    channels.py reaches peers with it)."""

    def call(instance_id: str, command: WorkerCall[Any]) -> Any:
        actor = ray.get_actor(actor_name(instance_id), namespace)
        return ray.get(actor.call.remote(command), timeout=timeout_s)

    return call


class RayHandle(HandleBase):
    """A router handle over the worker actor named `actor_name(instance_id)` in `namespace`.
    The handle methods are deploy/runtime/handle.py's; only how a call is made differs."""

    def __init__(
        self,
        instance_id: str,
        role: Role,
        actor: Any,
        namespace: str,
        call_timeout_s: float = 10.0,
        prefill_tp_sizes: dict[str, int] | None = None,
    ) -> None:
        super().__init__(instance_id, role, call_timeout_s, prefill_tp_sizes)
        self._executor = _CALLS
        self.namespace = namespace
        self._actor: Any | None = actor

    def _resolve(self) -> Any:
        if self._actor is None:
            try:
                self._actor = ray.get_actor(actor_name(self.instance_id), self.namespace)
            except ValueError:
                raise WorkerUnavailable(f"{self.instance_id}: no such actor (yet)") from None
        return self._actor

    def _invoke(self, command: WorkerCall[R], timeout_s: float) -> R:
        ref = self._resolve().call.remote(command)
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            ray.cancel(ref)
            raise WorkerUnavailable(
                f"{self.instance_id} did not answer {type(command).__name__} within {timeout_s:.1f}s"
            ) from None
        except RayActorError as exc:
            self._actor = None  # look it up again next time
            raise WorkerUnavailable(f"{self.instance_id} is down ({_first_line(exc)})") from None
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else None
            if cause is not None:
                raise cause from None
            raise


class ActorControl:
    """A worker's `send_control`: `deliver` on the peer actor, without waiting for it."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._actors: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, instance_id: str, message: Any) -> None:
        with self._lock:
            actor = self._actors.get(instance_id)
            if actor is None:
                actor = ray.get_actor(actor_name(instance_id), self.namespace)
                self._actors[instance_id] = actor
        actor.call.remote(Deliver(message))  # a lost message is covered by the peer's deadline


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
