"""The in-process engine: `LLMEngine` (one step at a time, every worker's core) and `LLM` (the
offline `generate` API for scripts, tests and benchmarks). A worker that moves KV in or out
gives the engine a KV connector (engine/kv_connector.py); the step loop is this one either way.

    engine = LLMEngine(EngineConfig(model_dir="..."))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...        # StepOutput: new tokens, finished, finish_reason
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.batch import ScheduledBatch
from engine.block_pool import BlockPool, PrefixCacheChanges
from engine.config import EngineConfig
from engine.executor import Executor
from engine.kv_connector import KVConnector
from engine.logprobs import (
    attach_logprobs,
    first_row_indices,
    process_first_rows,
    sampled_logprobs,
    split_logits,
)
from engine.outputs import RequestOutput, SchedulerStats, StepOutput, TokenLogprob
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.slo import PrefillGate, RequestSLO
from engine.speculative.draft import DraftModel
from engine.speculative.verify import verify
from engine.step_costs import StepCosts
from engine.structured.backend import GrammarBackend
from engine.structured.grammars import Grammars


class LLMEngine:
    """A scheduler, a sampler and an executor: prefill and decode mixed in one loop.

    Not thread-safe: call add_request / abort / step from one thread (a worker's loop).
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.connector = connector if connector is not None else KVConnector()
        self.executor = executor if executor is not None else Executor(config)
        model_config = self.executor.model_config
        vocab_size = model_config.vocab_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.block_pool = BlockPool(
            self.executor.num_kv_blocks, enable_caching=config.enable_prefix_caching
        )
        self.step_costs = StepCosts()  # learned from every step, read by the prefill gate
        gate = PrefillGate(self.step_costs) if config.slo_scheduling else None
        spec = config.speculative
        draft = None
        if spec is not None and spec.method == "draft":  # a draft model beside the target
            assert spec.draft_model is not None
            draft = DraftModel(config, spec.draft_model, model_config, self.executor.num_kv_blocks)
        self.draft = draft
        self.scheduler = Scheduler(
            self.block_pool,
            block_size=self.executor.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            chunk_size=config.chunk_size,
            max_model_len=self.max_model_len,
            eos_token_ids=model_config.eos_token_ids,
            seed=config.seed,
            connector=self.connector,
            gate=gate,
            speculative=config.speculative,
            step_costs=self.step_costs,
            release_window=model_config.release_window,
            draft=draft,
        )
        self.sampler = Sampler()
        eos_ids = model_config.eos_token_ids
        self.grammars = Grammars(lambda: _grammar_backend(config.model_dir, vocab_size, eos_ids))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float = 0.0,
        decodes_here: bool = True,
        slo: RequestSLO | None = None,
    ) -> Request:
        """Queue a request; raises ValueError for token ids outside the vocabulary or a prompt
        that leaves no room for a token (`check_fits`). One whose longest form exceeds the whole
        pool ends with an error at admission. `decodes_here=False`: the KV connector hands it
        off after its first token. `slo` (with `arrival_time` as time.time()): what the prefill
        gate schedules it by, when the engine has one."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        self.check_fits(request_id, prompt, None)
        request = Request(
            request_id, prompt, params, arrival_time, decodes_here=decodes_here, slo=slo
        )
        self.scheduler.add_request(request)
        self._start_grammar(request)
        return request

    def _start_grammar(self, request: Request) -> None:
        """Compile (or find cached) the request's grammar; it is admitted once compiled."""
        spec = request.params.structured
        if spec is not None and request.grammar is None:
            request.grammar = self.grammars.start(spec)

    def check_fits(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None
    ) -> None:
        """Raise ValueError unless the request can run here: token ids in the vocabulary, a
        prompt shorter than the model length and, with `params`, room in the whole pool for its
        longest form (a decode reservation checks that before any KV moves)."""
        vocab_size = self.executor.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids must be in [0, {vocab_size}) for this model, got {bad[:5]}"
            )
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0 or num_prompt >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {num_prompt} tokens; it needs 1 to "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len})"
            )
        if params is None:
            return
        max_len = min(num_prompt + params.max_tokens, self.max_model_len)
        num_blocks = -(-max_len // self.executor.block_size)
        if num_blocks > self.block_pool.num_blocks:
            raise ValueError(
                f"request {request_id!r} may grow to {max_len} tokens ({num_blocks} KV blocks), "
                f"but the pool has {self.block_pool.num_blocks}: lower max_tokens"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks; its end comes in the next step()."""
        return self.scheduler.abort(request_id)

    def step(self) -> list[StepOutput]:
        """Run one step; one StepOutput per request that gained a token or ended."""
        started = time.perf_counter()
        for request in self.connector.start_step():  # their KV landed: they join as prefilled
            self.scheduler.add_prefilled(request)
            self._start_grammar(request)  # its matcher resumes from the first token
        batch = self.scheduler.schedule()
        sampled: list[int] | list[list[int]] = []
        token_logprobs: dict[str, TokenLogprob] = {}
        requests = self.scheduler.requests
        first_tokens = {c.request_id: requests[c.request_id] for c in batch.chunks if c.all_logits}
        if batch:
            logits = self.executor.execute(batch)  # [batch.num_logits, vocab_size]
            logits = split_logits(batch, logits, requests)  # [batch.num_sampled + drafts, vocab]
            self._mask_by_grammars(batch, logits)
            if batch.num_draft:  # proposed tokens to verify
                drafts = [
                    c.token_ids[len(c.token_ids) - c.num_draft :] for c in batch.chunks if c.sample
                ]
                rows = self.scheduler.sampling_rows(batch)
                # a request with processors or logprobs proposes nothing: one row, its first
                first_rows = logits[first_row_indices(drafts)]
                speculator = self.scheduler.speculator
                assert speculator is not None
                probs = speculator.draft_probs([c.request_id for c in batch.chunks if c.sample])
                sampled = verify(process_first_rows(logits, rows, drafts), rows, drafts, probs)
                first_ids = [tokens[0] for tokens in sampled]
                token_logprobs = sampled_logprobs(batch, first_rows, rows, first_ids)
            elif batch.num_sampled:
                rows = self.scheduler.sampling_rows(batch)
                sampled = self.sampler(logits, rows)
                token_logprobs = sampled_logprobs(batch, logits, rows, sampled)
        outputs = self.scheduler.update(batch, sampled)
        if token_logprobs or first_tokens:
            attach_logprobs(outputs, token_logprobs, first_tokens)
        if batch:  # the whole step, as a decode's next token waits for it
            self.step_costs.observe(batch, time.perf_counter() - started)
        return outputs

    def _mask_by_grammars(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Mask, in place, the logits row each constrained request samples from (a constrained
        request proposes no tokens, so its row is its chunk's first), before the processors."""
        if not self.grammars.in_use:
            return  # an engine that never saw a constraint spends nothing per step here
        rows = []
        row = 0
        for chunk in batch.chunks:
            if not chunk.sample:
                continue
            request = self.scheduler.requests[chunk.request_id]
            if request.grammar is not None:
                rows.append((row, request))
            row += 1 + chunk.num_draft
        self.grammars.apply(logits, rows)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.connector.has_work()

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def prefix_cache_changes(self, snapshot: bool = False) -> PrefixCacheChanges:
        """What the prefix cache stored and evicted since the last call (BlockPool)."""
        return self.block_pool.take_cache_changes(snapshot)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()


class LLM:
    """Offline generation over token ids with continuous batching.

    `LLM(model_dir, dtype="float32", tensor_parallel_size=1, block_size=16, **engine_kwargs)`,
    where `engine_kwargs` are any other EngineConfig fields (num_kv_blocks, chunk_size, ...).
    """

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        block_size: int = 16,
        **engine_kwargs: Any,
    ) -> None:
        config = EngineConfig(
            model_dir=str(model_dir),
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            block_size=block_size,
            **engine_kwargs,
        )
        self.engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. All prompts are queued at once and
        join the running batch as soon as blocks and the token budget allow."""
        params_list = self._params_per_prompt(len(prompt_token_ids), params)
        requests: list[Request] = []
        try:
            for prompt, request_params in zip(prompt_token_ids, params_list, strict=True):
                request_id = f"gen-{next(self._request_counter)}"
                requests.append(self.engine.add_request(request_id, prompt, request_params))
        except ValueError:
            for request in requests:
                self.engine.abort(request.request_id)
            self.engine.step()  # drain the abort outputs
            raise
        errors: dict[str, str] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        pending = {request.request_id for request in requests}
        while pending:
            for out in self.engine.step():
                if out.logprobs is not None:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                if out.finished:
                    pending.discard(out.request_id)
                    if out.error is not None:
                        errors[out.request_id] = out.error
        return [
            RequestOutput(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=list(r.output_token_ids),
                finish_reason=r.finish_reason,
                num_cached_tokens=r.num_cached_tokens,
                num_preemptions=r.num_preemptions,
                error=errors.get(r.request_id),
                num_spec_proposed=r.spec.num_proposed if r.spec else 0,
                num_spec_accepted=r.spec.num_accepted if r.spec else 0,
                logprobs=logprobs.get(r.request_id),
                prompt_logprobs=r.prompt_logprobs,
            )
            for r in requests
        ]

    @staticmethod
    def _params_per_prompt(
        num_prompts: int, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * num_prompts
        params_list = list(params)
        if len(params_list) != num_prompts:
            raise ValueError(
                f"params has {len(params_list)} entries for {num_prompts} prompts; "
                "pass one SamplingParams, or one per prompt"
            )
        return params_list

    @property
    def stats(self) -> SchedulerStats:
        return self.engine.stats

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _grammar_backend(
    model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]
) -> GrammarBackend:
    """xgrammar over the model folder's tokenizer, stopping at the model's EOS ids."""
    from transformers import AutoTokenizer

    from engine.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(AutoTokenizer.from_pretrained(model_dir), vocab_size, eos_token_ids)
