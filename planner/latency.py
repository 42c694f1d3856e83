"""Step times in ms from a TPProfile: DistServe's functional form plus our extra terms.

prefill stage  (a + b*Σl + c*Σl²) / pp + pp          DistServe's simulator, per pipeline stage
decode stage   (a + b*Σ(ctx+1) + c*B) / pp            small- or large-batch triple by B; a
                                                      measured decoding_by_batch[B] replaces
                                                      a + c*B (the step is not linear in B)
overhead       base + per_token*Σctx + per_seq*B        added once per step (first stage)
mixed step     a' + b_p*Σm + c_p*Σ(m² + 2*m*p) + b_d*Σ(ctx+1) + c_d*B
               one colocated step: chunks m after p cached tokens, plus a decode batch;
               with a measured chunked_prefill triple (a', b', c') its prompt part is that
               triple's (pdserve profile times mixed steps: a chunk beside decodes costs more
               than alone, ~10% at 512 tokens on CPU).
               Chunking a prompt of l into pieces keeps Σ(m² + 2mp) = l², so the chunks
               of one prompt cost what its whole prefill costs, less the repeated intercept.
KV transfer    per_message + bytes_per_token * tokens / bandwidth
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.profile import TPProfile


@dataclass(frozen=True)
class StepModel:
    """The step times of one instance: a TP size's profile at a pipeline depth."""

    profile: TPProfile
    pp: int = 1

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ValueError(f"pp must be >= 1, got {self.pp}")

    def prefill_stage_ms(self, sum_len: float, sum_len_sq: float) -> float:
        a, b, c = self.profile.prefill
        return (a + b * sum_len + c * sum_len_sq) / self.pp + self.pp

    def decode_stage_ms(self, batch_size: int, sum_ctx: float) -> float:
        """One decode step of `batch_size` requests whose contexts add up to `sum_ctx`."""
        return self.profile.decode_step_ms(batch_size, sum_ctx) / self.pp

    def overhead_ms(self, num_tokens: float, num_seqs: int = 0) -> float:
        base, per_token = self.profile.overhead
        return base + per_token * num_tokens + self.profile.overhead_per_seq * num_seqs

    def mixed_ms(
        self, batch_size: int, sum_ctx: float, sum_chunk: float, sum_chunk_attn: float
    ) -> float:
        """One colocated step (pp = 1): decodes plus prompt chunks.

        `sum_chunk_attn` is Σ(m² + 2*m*p) over the chunks (m new tokens after p computed ones).
        """
        ap, bp, cp = self.profile.prefill
        if sum_chunk == 0:
            return self.decode_stage_ms(batch_size, sum_ctx) if batch_size else 0.0
        if batch_size == 0:
            return ap + bp * sum_chunk + cp * sum_chunk_attn
        ad, bd, cd = self.profile.decode_triple(batch_size)
        decode_part = bd * (sum_ctx + batch_size) + cd * batch_size
        if self.profile.chunked_prefill is not None:  # measured mixed steps
            am, bm, cm = self.profile.chunked_prefill
            return am + bm * sum_chunk + cm * sum_chunk_attn + decode_part
        intercept = self.profile.chunked_intercept
        if intercept is None:
            intercept = max(ap, ad)
        return intercept + bp * sum_chunk + cp * sum_chunk_attn + decode_part


def transfer_ms(
    num_tokens: int, bytes_per_token: float, bandwidth_GBps: float, per_message_ms: float
) -> float:
    """Time to move one request's KV over a link of `bandwidth_GBps` (10^9 bytes/s)."""
    if bandwidth_GBps <= 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth_GBps}")
    return per_message_ms + num_tokens * bytes_per_token / (bandwidth_GBps * 1e6)
