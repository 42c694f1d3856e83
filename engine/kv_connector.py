"""The KV connector: the engine's hooks at the points where a disaggregated step differs.

In the spirit of vLLM v1's scheduler-side connector. `LLMEngine.step` and its `Scheduler` call
them; a colocated engine runs with this base class, whose hooks do nothing:

    LLMEngine.step
      connector.start_step()        transfers progress; requests whose KV landed here are
                                    returned and join the scheduler as prefilled
      schedule, execute, sample
      Scheduler.update              a request samples its first token and the stop rule (the
                                    scheduler's, with the request's own parameters) lets it go
                                    on: connector.hand_off(request) -> True when its decode runs
                                    elsewhere; the connector has taken its own reference on the
                                    blocks, and the request ends here as handed off
      Scheduler._finish             a request ends here any other way (stop, length, abort,
                                    error): connector.request_finished(request)

Implementations: worker/send.py (the sending side) and worker/receive.py
(the receiving side); worker/instance.py combines them, so one instance can hold both. Their rank
sides run on every TP rank as the executor's rank extension, reached with typed RankCommands.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request


class KVConnector:
    """No KV moves in or out: the colocated engine."""

    def start_step(self) -> list[Request]:
        """Progress the transfers in flight; return the requests whose KV has landed here."""
        return []

    def hand_off(self, request: Request) -> bool:
        """`request` sampled its first token and goes on: True if its decode runs elsewhere
        (the connector then holds the blocks it needs and starts the send)."""
        return False

    def request_finished(self, request: Request) -> None:
        """`request` ended here (stop, length, abort or error) before any hand-off."""

    def has_work(self) -> bool:
        """Transfers in flight: the owner keeps stepping even with no request to compute."""
        return False


class KVConnectors(KVConnector):
    """Several sides on one engine (an instance that both sends and receives KV)."""

    def __init__(self, sides: Sequence[KVConnector] = ()) -> None:
        self.sides = list(sides)

    def add(self, side: KVConnector) -> None:
        self.sides.append(side)

    def start_step(self) -> list[Request]:
        return [request for side in self.sides for request in side.start_step()]

    def hand_off(self, request: Request) -> bool:
        return any(side.hand_off(request) for side in self.sides)

    def request_finished(self, request: Request) -> None:
        for side in self.sides:
            side.request_finished(request)

    def has_work(self) -> bool:
        return any(side.has_work() for side in self.sides)
