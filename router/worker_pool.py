"""The router's view of its workers: handles, their latest loads, and the event demultiplexer.

One background task per handle long-polls `poll_events` and routes each TokenEvent by
request_id to that request's `RequestChannel` (events for a request that is gone are dropped:
it was aborted, and the abort reached the worker).

Workers never see the client's request_id: each placement of an attempt (the dispatcher may try
several instances) gets a worker-side id of its own, `<client id>@<router run>-<n>.<k>`, used for
every worker call, event, abort and KV ticket, and only the current placement's id is routed to
the channel. A client that reuses an id (right after cancelling it, or concurrently) can then
never receive another attempt's tokens, nor have its new attempt hit by the abort of the old one;
and an instance that took a placement the router gave up on (a submit that timed out but landed)
cannot feed the retry's stream. Another task refreshes every load each `load_refresh_interval_s`
for the policies and the metrics; when a policy routes by prefix (kv_aware), the prefill
instances' reports also carry their prefix caches' changes into the `PrefixIndex`.

A handle that fails (WorkerUnavailable, a timeout, any error) is marked unhealthy: policies
stop choosing it, and every request holding state on it gets an `InstanceLost` in its channel.
It becomes healthy again when a load report says so (a restarted worker), and requests waiting
for an instance to come back (`wait_for_recovery`) wake up. The metrics follow:
a lost instance shows as down, with nothing running and no blocks in use, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.policies import InstanceState
from router.prefix_index import SNAPSHOT_INTERVAL_S, PrefixIndex
from router.worker_api import (
    DecodeHandle,
    InstanceLoad,
    PrefillHandle,
    PrefixReport,
    Role,
    TokenEvent,
    WorkerHandle,
)

logger = logging.getLogger(__name__)
_CANCELLED_LOOP_WAIT_S = 1.0  # a cancelled poll or load loop ends at once, or is left
_RETRY_AFTER_FAILURE_S = 0.5


def client_request_id(worker_request_id: str) -> str:
    """The client's request_id inside a worker-side id (an id without '@' is its own)."""
    client_id, separator, _attempt = worker_request_id.rpartition("@")
    return client_id if separator else worker_request_id


@dataclass(frozen=True)
class InstanceLost:
    instance_id: str
    reason: str
    request_id: str  # the placement it was lost for: a later one on the restarted instance lives


class RequestChannel:
    """Where a request's events arrive, and which instances hold state for it.

    An inbox for one reader: `put` never blocks, `take_all` returns everything that arrived
    since the last call. It is built from a deque and one future because it sits on the path of
    every token: asyncio.Queue costs a running-loop lookup (a getpid system call on Python 3.11)
    and several objects per item.
    """

    def __init__(self, attempt_id: str) -> None:
        self.attempt_id = attempt_id  # unique to this attempt
        self.request_id = attempt_id  # the worker-side id of the current placement
        self.num_placements = 0
        self.holder_ids: set[str] = set()  # instances that may hold state under `request_id`
        # earlier placements given up on: (worker-side id, the instances that may hold it)
        self.abandoned: list[tuple[str, set[str]]] = []
        self._loop = asyncio.get_running_loop()
        self._items: deque[TokenEvent | InstanceLost] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: TokenEvent | InstanceLost) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take_all(self) -> list[TokenEvent | InstanceLost]:
        """Every item not yet taken, in arrival order; waits for one if there is none."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


@dataclass
class _Instance:
    handle: WorkerHandle
    load: InstanceLoad
    healthy: bool = False  # until the first load report says so
    num_outstanding_prompt_tokens: int = 0
    num_active_requests: int = 0
    num_blocks_reserved_since_load: int = 0
    next_prefix_snapshot_at: float = 0.0  # time.monotonic(); 0: the next report is a snapshot

    def state(self) -> InstanceState:
        return InstanceState(
            self.handle.instance_id,
            self.load,
            self.num_outstanding_prompt_tokens,
            self.num_active_requests,
            self.num_blocks_reserved_since_load,
        )


class WorkerPool:
    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        prefill_handles: Sequence[PrefillHandle],
        decode_handles: Sequence[DecodeHandle] = (),
        prefix_index: PrefixIndex | None = None,
    ) -> None:
        _check_roles(prefill_handles, decode_handles)
        self._config = config
        self._metrics = metrics
        # Fed with the prefill instances' prefix-cache reports when a policy reads it.
        self._prefix_index = prefix_index
        self._instances: dict[str, _Instance] = {}
        for handle in [*prefill_handles, *decode_handles]:
            if handle.instance_id in self._instances:
                raise ValueError(f"two worker handles share the instance id {handle.instance_id!r}")
            self._instances[handle.instance_id] = _Instance(
                handle, InstanceLoad(handle.instance_id, handle.role, healthy=False)
            )
        self._prefill_ids = [h.instance_id for h in prefill_handles]
        self._decode_ids = [h.instance_id for h in decode_handles]
        self._prefill_handles = {h.instance_id: h for h in prefill_handles}
        self._decode_handles: dict[str, DecodeHandle] = {h.instance_id: h for h in decode_handles}
        # Adaptive instances are both: each prefills, decodes, or runs a request start to end.
        self.adaptive = prefill_handles[0].role is Role.ADAPTIVE
        if self.adaptive:
            self._decode_ids = list(self._prefill_ids)
            self._decode_handles = {h.instance_id: h for h in prefill_handles}  # type: ignore[misc]
        self._channels: dict[str, RequestChannel] = {}  # by worker-side request id
        # A run token keeps ids unique across router restarts too: workers may outlive a router.
        self._id_prefix = uuid.uuid4().hex[:8]
        self._attempt_numbers = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._abort_tasks: set[asyncio.Task[None]] = set()
        # Set, and replaced by a fresh one, each time an instance becomes healthy.
        self._recovered: asyncio.Event | None = None
        self._space_freed: asyncio.Event | None = None

    @property
    def prefix_index(self) -> PrefixIndex | None:
        """What the prefill instances' prefix caches hold, when a policy routes by it."""
        return self._prefix_index

    @property
    def disaggregated(self) -> bool:
        """Every request prefilled on one instance and decoded on another (not adaptive)."""
        return bool(self._decode_ids) and not self.adaptive

    async def start(self) -> None:
        await self.refresh_loads()
        for instance_id in self._instances:
            self._tasks.append(asyncio.create_task(self._poll_loop(instance_id)))
            self._tasks.append(asyncio.create_task(self._load_loop(instance_id)))

    async def stop(self) -> None:
        """Cancel the poll and load loops and let the aborts in flight finish, within a bound:
        a loop cancelled in the middle of a worker call can stay pending after its call's own
        deadline (seen on Python 3.11: wait_for around a to_thread call of a worker that was
        just killed), and a router that is stopping must not wait on it for good."""
        for task in self._tasks:
            task.cancel()
        bounds = ((self._tasks, _CANCELLED_LOOP_WAIT_S), (self._abort_tasks, None))
        for tasks, bound_s in bounds:
            if tasks:
                timeout_s = bound_s or self._config.worker_timeout_s + 1.0  # an abort's deadline
                _, stuck = await asyncio.wait(list(tasks), timeout=timeout_s)
                if stuck:
                    logger.warning("%d worker calls still pending at shutdown: left", len(stuck))
        self._tasks.clear()

    # -- requests ---------------------------------------------------------------------------

    def open_channel(self, client_request_id: str) -> RequestChannel:
        """A channel for one attempt at a request, under a worker-side id no other has had.
        (What follows the last '@' is the attempt number, so no two attempts, whatever their
        client ids, share a worker-side id.)"""
        attempt_id = f"{client_request_id}@{self._id_prefix}-{next(self._attempt_numbers)}"
        channel = self._channels[attempt_id] = RequestChannel(attempt_id)
        return channel

    def new_placement(self, channel: RequestChannel) -> str:
        """A fresh worker-side id for the channel's next placement; from now on only its events
        reach the channel (an earlier placement's are dropped: the router gave up on it)."""
        self._channels.pop(channel.request_id, None)
        channel.request_id = f"{channel.attempt_id}.{channel.num_placements}"
        channel.num_placements += 1
        self._channels[channel.request_id] = channel
        return channel.request_id

    def close_channel(self, channel: RequestChannel) -> None:
        self._channels.pop(channel.request_id, None)

    def handle(self, instance_id: str) -> WorkerHandle:
        return self._instances[instance_id].handle

    def prefill_handle(self, instance_id: str) -> PrefillHandle:
        return self._prefill_handles[instance_id]

    def decode_handle(self, instance_id: str) -> DecodeHandle:
        return self._decode_handles[instance_id]

    def prefill_candidates(self, exclude: Collection[str] = ()) -> list[InstanceState]:
        return self._candidates(self._prefill_ids, exclude)

    def decode_candidates(self, exclude: Collection[str] = ()) -> list[InstanceState]:
        return self._candidates(self._decode_ids, exclude)

    def _candidates(self, instance_ids: list[str], exclude: Collection[str]) -> list[InstanceState]:
        return [
            self._instances[i].state()
            for i in instance_ids
            if self._instances[i].healthy and i not in exclude
        ]

    def recovery_mark(self) -> object:
        """A mark to pass to `wait_for_recovery`: instances that become healthy after it count."""
        if self._recovered is None:
            self._recovered = asyncio.Event()
        return self._recovered

    async def wait_for_recovery(self, mark: object, timeout_s: float) -> bool:
        """Wait until an instance has become healthy since `mark` was taken; False on timeout."""
        assert isinstance(mark, asyncio.Event)
        if timeout_s <= 0 and not mark.is_set():
            return False
        try:
            await asyncio.wait_for(mark.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def healthy(self) -> bool:
        """Serving needs a healthy prefill (or colocated) instance, and a decode one if split."""
        has_prefill = bool(self.prefill_candidates())
        return has_prefill and (not self.disaggregated or bool(self.decode_candidates()))

    def note_dispatch(self, instance_id: str, num_prompt_tokens: int, is_prefill: bool) -> None:
        instance = self._instances[instance_id]
        instance.num_active_requests += 1
        if is_prefill:
            instance.num_outstanding_prompt_tokens += num_prompt_tokens
        else:
            num_blocks = math.ceil(num_prompt_tokens / self._config.block_size)
            instance.num_blocks_reserved_since_load += num_blocks

    def note_prefilled(self, instance_id: str, num_prompt_tokens: int) -> None:
        instance = self._instances[instance_id]
        instance.num_outstanding_prompt_tokens -= num_prompt_tokens

    def note_done(self, instance_id: str) -> None:
        self._instances[instance_id].num_active_requests -= 1
        if self._space_freed is not None:  # a request ended there: its KV space is free again
            self._space_freed.set()
            self._space_freed = None

    def space_mark(self) -> object:
        """A mark to pass to `wait_for_space`: requests that end after it count."""
        if self._space_freed is None:
            self._space_freed = asyncio.Event()
        return self._space_freed

    async def wait_for_space(self, mark: object, timeout_s: float) -> None:
        """Wait until a request has ended on some instance since `mark`, or `timeout_s`."""
        assert isinstance(mark, asyncio.Event)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(mark.wait(), max(timeout_s, 0.0))

    def space_may_free(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt refused for space may fit later: a request of this router runs on
        some instance (its end frees space), and some instance's whole pool holds the prompt."""
        instances = self._instances.values()
        num_blocks = math.ceil(num_prompt_tokens / self._config.block_size)
        return any(i.num_active_requests > 0 for i in instances) and any(
            i.load.num_total_blocks >= num_blocks for i in instances
        )

    def abort_everywhere(self, request_id: str, instance_ids: set[str]) -> None:
        """Tell each instance to free the request's state; runs on its own, so a cancelled
        caller (a client that went away) cannot interrupt it."""
        for instance_id in instance_ids:
            task = asyncio.create_task(self._abort(instance_id, request_id))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)

    async def _abort(self, instance_id: str, request_id: str) -> None:
        handle = self._instances[instance_id].handle
        try:
            await asyncio.wait_for(handle.abort(request_id), self._config.worker_timeout_s)
        except Exception as exc:  # the worker is gone or stuck: its own restart frees state
            logger.warning("abort of %s on %s failed: %r", request_id, instance_id, exc)

    # -- background tasks -------------------------------------------------------------------

    async def _poll_loop(self, instance_id: str) -> None:
        handle = self._instances[instance_id].handle
        timeout_s = self._config.poll_timeout_s + self._config.worker_timeout_s
        while True:
            try:
                events = await asyncio.wait_for(
                    handle.poll_events(self._config.poll_timeout_s), timeout_s
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lose(instance_id, f"polling its events failed: {exc!r}")
                await asyncio.sleep(_RETRY_AFTER_FAILURE_S)
                continue
            for event in events:
                channel = self._channels.get(event.request_id)
                if channel is not None:
                    channel.put(event)

    async def _load_loop(self, instance_id: str) -> None:
        """One loop per instance: a worker that hangs delays only its own reports."""
        while True:
            await asyncio.sleep(self._config.load_refresh_interval_s)
            await self._refresh_load(instance_id)

    async def refresh_loads(self) -> None:
        await asyncio.gather(*(self._refresh_load(i) for i in self._instances))

    async def _refresh_load(self, instance_id: str) -> None:
        instance = self._instances[instance_id]
        prefix = self._prefix_report(instance)
        try:
            load = await asyncio.wait_for(
                instance.handle.load(prefix), self._config.worker_timeout_s
            )
        except asyncio.CancelledError:
            instance.next_prefix_snapshot_at = 0.0  # the worker may have told changes: lost
            raise
        except Exception as exc:
            self._lose(instance_id, f"its load report failed: {exc!r}")
            return
        if self._prefix_index is not None and load.prefix_cache is not None:
            self._prefix_index.apply(instance_id, load.prefix_cache)
        instance.load = load
        instance.num_blocks_reserved_since_load = 0
        if instance.healthy and not load.healthy:
            self._lose(instance_id, "it reports itself unhealthy")
        if load.healthy and not instance.healthy and self._recovered is not None:
            self._recovered.set()
            self._recovered = None
        instance.healthy = load.healthy
        self._metrics.observe_load(load)

    def _prefix_report(self, instance: _Instance) -> PrefixReport:
        """What the next load report should tell of the instance's prefix cache: nothing
        unless a policy reads the index and the instance prefills; else its changes, or a
        snapshot when one is due (router/prefix_index.py)."""
        if self._prefix_index is None or instance.handle.role is Role.DECODE:
            return PrefixReport.NONE
        now = time.monotonic()
        if now < instance.next_prefix_snapshot_at:
            return PrefixReport.CHANGES
        instance.next_prefix_snapshot_at = now + SNAPSHOT_INTERVAL_S
        return PrefixReport.SNAPSHOT

    def _lose(self, instance_id: str, reason: str) -> None:
        instance = self._instances[instance_id]
        if instance.healthy:
            logger.warning("worker %s is unavailable: %s", instance_id, reason)
        instance.healthy = False
        instance.next_prefix_snapshot_at = 0.0
        if self._prefix_index is not None:
            self._prefix_index.forget(instance_id)
        self._metrics.observe_down(instance_id, instance.handle.role)
        for channel in self._channels.values():
            if instance_id in channel.holder_ids:
                channel.put(InstanceLost(instance_id, reason, channel.request_id))


def _check_roles(
    prefill_handles: Sequence[PrefillHandle], decode_handles: Sequence[DecodeHandle]
) -> None:
    if not prefill_handles:
        raise ValueError("the router needs at least one prefill or colocated worker handle")
    prefill_roles = {h.role for h in prefill_handles}
    if not prefill_roles <= {Role.PREFILL, Role.COLOCATED, Role.ADAPTIVE} or (
        len(prefill_roles) > 1
    ):
        raise ValueError(
            f"prefill handles must all be PREFILL, all COLOCATED or all ADAPTIVE, got "
            f"{prefill_roles}"
        )
    if Role.ADAPTIVE in prefill_roles and decode_handles:
        raise ValueError(
            "ADAPTIVE handles decode themselves and for each other; pass no decode handles"
        )
    if any(h.role != Role.DECODE for h in decode_handles):
        raise ValueError("decode handles must have role DECODE")
    if Role.PREFILL in prefill_roles and not decode_handles:
        raise ValueError("PREFILL handles need at least one DECODE handle to hand their KV to")
    if Role.COLOCATED in prefill_roles and decode_handles:
        raise ValueError("COLOCATED handles decode themselves; pass no decode handles")
