"""Speculative decoding on the decode side: propose a few tokens cheaply, verify them all in one
target forward, keep the longest prefix the target agrees with plus one token of its own.

    config.py     SpeculativeConfig: the method and its knobs (EngineConfig.speculative)
    ngram.py      prompt lookup: the continuation of the latest earlier match of the last n tokens
    draft.py      a draft model beside the target, with its own paged KV, drafting in one batch
    layer_skip.py a draft cut from the target itself (some of its layers), for want of a hub
    state.py      per-request counts and the adaptive number of proposed tokens
    verify.py     greedy acceptance and rejection sampling over the verification logits

A request's verification is one chunk of the step: [last token, d1..dk] at positions
[n-1, n+k), run through the attention back end's multi-token-query-over-cached-context path
(the one chunked prefill uses), batched with the other requests' plain decodes. The scheduler
rolls back the KV of rejected tokens by setting `num_computed_tokens` to the accepted length
and freeing the blocks past it; a rejected token is never in the request's tokens, so it never
enters a prefix-cache block hash.
"""
