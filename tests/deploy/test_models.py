"""deploy/config/models.py without the SmolLM2 package: model names in the config, and the TP sizes it
allows agreeing with the engine's own sharding rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.config.models import allowed_tp_sizes
from deploy.config.serve_config import ConfigError, parse_config
from engine.kv_cache import local_kv_heads
from engine.parallel import divide


def engine_accepts(num_heads: int, num_kv_heads: int, width: int, tp: int) -> bool:
    """What the engine's layers do when they shard: divide heads and MLP width, place KV heads."""
    try:
        divide(num_heads, tp, "num_attention_heads")
        divide(width, tp, "output size")
        for rank in range(tp):
            local_kv_heads(num_kv_heads, tp, rank)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,width",
    [(9, 3, 1536), (8, 2, 704), (32, 8, 11008), (12, 12, 3072), (16, 4, 100), (6, 1, 60)],
)
def test_allowed_tp_sizes_agree_with_the_engine(
    tmp_path: Path, num_heads: int, num_kv_heads: int, width: int
) -> None:
    config = {
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": width,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = [tp for tp in range(1, 65) if engine_accepts(num_heads, num_kv_heads, width, tp)]
    assert allowed_tp_sizes(tmp_path) == expected


def test_model_names_are_accepted_and_unknown_ones_say_what_to_give() -> None:
    assert parse_config({"model": "smollm2"}).model == "smollm2"
    assert parse_config({"model": "demo"}).model == "demo"
    with pytest.raises(ConfigError, match="'smollm2'.*'demo'"):
        parse_config({"model": "smollm3"})


def test_serve_refuses_an_unknown_architecture_before_starting_workers(
    tiny_model, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy.cli.main import main
    from engine.models import SUPPORTED_ARCHITECTURES

    model_dir = tmp_path / "falcon"
    model_dir.mkdir()
    config = json.loads((Path(tiny_model("llama")) / "config.json").read_text())
    (model_dir / "config.json").write_text(
        json.dumps({**config, "architectures": ["FalconForCausalLM"]})
    )
    with pytest.raises(ConfigError) as excinfo:
        parse_config({"model": str(model_dir)})
    message = str(excinfo.value)
    assert "FalconForCausalLM" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)
    # `pdserve serve` exits on it at once: no cluster, no worker process is started
    assert main(["serve", "--model", str(model_dir)]) != 0
    assert "FalconForCausalLM" in capsys.readouterr().err


def test_moe_tp_sizes_split_the_experts_width_too(tmp_path: Path) -> None:
    config = {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 128,  # the dense layers': splits over 1, 2, 4, 8
        "moe_intermediate_size": 36,  # each expert's: over 1, 2, 4 only (not 8)
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert allowed_tp_sizes(tmp_path) == [1, 2, 4]


KEEPS_TRITON_OUT = """
import sys
from deploy.config.models import _without_triton
with _without_triton():
    from transformers import LlamaForCausalLM  # imports torch._dynamo, which looks for Triton
    assert LlamaForCausalLM is not None
kept_out = "triton" not in sys.modules
import torch.utils._triton
print(kept_out, torch.utils._triton.has_triton_package())
"""


def test_the_gguf_conversion_keeps_triton_out_and_leaves_it_findable() -> None:
    """The first demo converts SmolLM2 in its own process: were Triton imported there, its
    bindings would print a page of leak warnings at exit. After the conversion Triton is found
    again (torch's cached answer is cleared)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", KEEPS_TRITON_OUT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
    assert "nanobind" not in done.stderr
