"""The engine's structured outputs: grammars compiled off the step loop, one matcher per request.

    grammars = Grammars(backend_factory)
    request.grammar = grammars.start(spec)      # at admission: a cached grammar, or a compile
    ...                                          # the scheduler admits it once `ready`
    grammars.apply(logits, rows)                 # before sampling: one bitmask, one batched apply

Compilation runs on a thread of its own; a request whose grammar is not compiled yet waits in
the queue without holding the batch (the scheduler passes over it). Compiled grammars are kept
in an LRU of `max_cached` specs, shared by every request with an equal spec.

A matcher is a function of the tokens it accepted, so it is never shipped: `GrammarState.sync`
brings it up to the request's tokens, the output before a migration (the prompt's last
`prior_output_tokens`) and then the output. The decode side of a KV hand-off rebuilds it from
the first token the prefill side sampled under the same grammar; a recomputed (preempted) or
migrated request does the same. The mask is applied on the driver, which samples for every TP
rank, so once per step.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.structured.backend import GrammarBackend, GrammarError, Matcher
from engine.structured.spec import StructuredOutput

if TYPE_CHECKING:
    from engine.request import Request


class GrammarState:
    """One request's grammar: its compile, then its matcher and how many tokens it accepted."""

    def __init__(self, compiled: Future[object], backend: Callable[[], GrammarBackend]) -> None:
        self._compiled = compiled
        self._backend = backend
        self._matcher: Matcher | None = None
        self.num_accepted = 0

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar does not compile, once `ready`."""
        exc = self._compiled.exception() if self.ready else None
        return None if exc is None else str(exc)

    def sync(self, request: Request) -> Matcher:
        """The matcher, advanced over the request's tokens it has not seen: the output from
        before a migration (the prompt's last `prior_output_tokens`), then the output. Raises
        GrammarError at a token it refuses."""
        matcher = self._matcher
        if matcher is None:
            matcher = self._matcher = self._backend().matcher(self._compiled.result())
        output = request.output_token_ids
        prior = request.params.prior_output_tokens
        num_prompt = request.num_prompt_tokens
        while self.num_accepted < prior + len(output):
            i = self.num_accepted
            token_id = request.prompt_token_ids[num_prompt - prior + i] if i < prior else None
            if token_id is None:
                token_id = output[i - prior]
            if not matcher.accept(token_id):
                raise GrammarError(f"token {token_id} does not follow the grammar")
            self.num_accepted += 1
        return matcher

    def terminated(self, request: Request) -> bool:
        """Its grammar ended with the request's last token; a token the grammar refused (only
        a processor that masked every allowed token, as min_tokens can, makes one) ends it too."""
        try:
            return self.sync(request).terminated
        except GrammarError:
            return True


class Grammars:
    """Compiles and caches grammars for one engine. The backend is built on first use (it
    loads the tokenizer), so an engine that never sees a constraint never pays for it."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], max_cached: int = 256) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._max_cached = max_cached
        self._cache: collections.OrderedDict[StructuredOutput, Future[object]] = (
            collections.OrderedDict()
        )
        self._pool: ThreadPoolExecutor | None = None
        self.in_use = False  # a request asked for a grammar: steps look for constrained rows

    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def start(self, spec: StructuredOutput) -> GrammarState:
        """The state of a request under `spec`: ready at once on a cache hit."""
        self.in_use = True
        return GrammarState(self.compile(spec), self.backend)

    def compile(self, spec: StructuredOutput) -> Future[object]:
        """The compiled grammar of `spec`, cached or on its way."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and future.done() and future.exception() is not None:
                future = None  # a failure is not cached: the next request tries again
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
                future = self._pool.submit(self._compile, spec)
                self._cache[spec] = future
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec)
        return future

    def _compile(self, spec: StructuredOutput) -> object:
        return self.backend().compile(spec)

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, Request]]) -> None:
        """Mask `logits` [n, vocab] in place: for each (row index, request with a grammar), every
        token the grammar does not allow next gets -inf. One bitmask for the batch (the rows of
        unconstrained requests allow everything), one batched apply."""
        if not rows:
            return
        backend = self.backend()
        bitmask = backend.allocate_bitmask(logits.shape[0])
        for row, request in rows:
            assert request.grammar is not None
            request.grammar.sync(request).fill_bitmask(bitmask, row)
        backend.apply_bitmask(logits, bitmask, [row for row, _ in rows])

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GrammarError", "GrammarState", "Grammars"]
