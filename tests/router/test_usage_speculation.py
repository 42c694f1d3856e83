"""The OpenAI usage of a speculating request: completion_tokens_details counts its proposed
tokens the model accepted and rejected (OpenAI's predicted-output fields), summed over its n
choices, and 0 and 0 without speculation."""

from __future__ import annotations

import json

from router.generation import GenerationChunk
from router.http_api.translate import ResponseShape


def last_chunk(index: int, proposed: int, accepted: int) -> GenerationChunk:
    return GenerationChunk(
        "r",
        [7, 8],
        "ab",
        finish_reason="length",
        num_prompt_tokens=5,
        num_completion_tokens=2,
        num_spec_proposed_tokens=proposed,
        num_spec_accepted_tokens=accepted,
        index=index,
    )


def test_usage_reports_accepted_and_rejected_predictions() -> None:
    shape = ResponseShape(
        chat=True, response_id="r", model="m", created=0, num_prompt_tokens=5, n=2
    )
    shape.add(last_chunk(0, proposed=10, accepted=7))
    shape.add(last_chunk(1, proposed=4, accepted=1))
    usage = json.loads(shape.complete().model_dump_json())["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["completion_tokens_details"] == {
        "accepted_prediction_tokens": 8,
        "rejected_prediction_tokens": 6,
    }
    plain = ResponseShape(chat=False, response_id="r", model="m", created=0, num_prompt_tokens=5)
    plain.add(last_chunk(0, proposed=0, accepted=0))
    details = json.loads(plain.complete().model_dump_json())["usage"]["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
