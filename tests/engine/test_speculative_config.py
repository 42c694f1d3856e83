"""The serve config's `speculative` section: parsed at the edge, unknown keys and bad values
refused by name, and carried into every instance's EngineConfig."""

from __future__ import annotations

import pytest

from deploy.config.checks import ConfigError
from deploy.config.cluster_spec import engine_config
from deploy.config.serve_config import parse_config
from engine.speculative.config import SpeculativeConfig


def test_section_reaches_the_engine_config() -> None:
    config = parse_config({"speculative": {"method": "ngram", "num_tokens": 6}})
    engine = engine_config(config, "/models/x", 1)
    assert engine.speculative == SpeculativeConfig(method="ngram", num_tokens=6)
    assert engine_config(parse_config({}), "/models/x", 1).speculative is None
    draft = parse_config({"speculative": {"method": "draft", "draft_model": "/models/d"}})
    assert engine_config(draft, "/models/x", 1).speculative == SpeculativeConfig(
        method="draft", draft_model="/models/d"
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"methd": "ngram"}, "unknown key 'methd' in speculative (did you mean 'method'?)"),
        ({"method": "eagle"}, "speculative.method must be ngram, draft or null"),
        ({"method": "draft"}, "speculative.draft_model is needed with method draft"),
        ({"method": "draft", "draft_model": 3}, "speculative.draft_model must be a model folder"),
        ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_tokens": "4"}, "speculative.num_tokens must be an integer"),
        ({"method": "ngram", "num_tokens": 33}, "at most 32"),
        ({"prompt_lookup_min": 5}, "must not exceed speculative.prompt_lookup_max"),
        ({"method": "ngram", "draft_model": "/m"}, "and only with it"),
    ],
)
def test_bad_sections_are_refused_by_name(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"speculative": section})
    assert message in str(info.value)


def test_acceptance_metrics_follow_the_worker_load() -> None:
    from router.metrics import RouterMetrics  # noqa: PLC0415 (router side of the same counts)
    from worker.protocol import InstanceLoad, LoadDetails, Role  # noqa: PLC0415

    metrics = RouterMetrics()
    details = LoadDetails(num_spec_proposed_tokens=40, num_spec_accepted_tokens=30)
    metrics.observe_load(InstanceLoad("decode-0", Role.DECODE, details=details))
    labels = {"instance": "decode-0", "role": "decode"}
    sample = metrics.registry.get_sample_value
    assert sample("pdserve:spec_decode_num_draft_tokens_total", labels) == 40.0
    assert sample("pdserve:spec_decode_num_accepted_tokens_total", labels) == 30.0
    assert sample("pdserve:spec_decode_acceptance_rate", labels) == 0.75
