"""The demo model: a small Llama-shaped model with a real byte-level BPE tokenizer, made locally.

There is no model hub at run time, so `pdserve demo` (and the cold-start script) build this model
on first use into a cache folder (deploy/config/models.py): a tokenizer trained with HF
`tokenizers` on the text below, and a model that transformers builds from a fixed seed and then
fits to that same text for a few seconds, so that greedy continuations of the demo prompts are
readable sentences rather than the noise of random weights. It is saved with `save_pretrained`
and loaded by pdserve's own loader.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEMO_VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "Disaggregated serving splits prefill and decode onto different GPUs.",
    "The prefill instance computes the prompt's KV cache and the first token.",
    "The decode instance receives the KV cache and generates the remaining tokens one by one.",
    "Time to first token measures how long a user waits before text starts to stream.",
    "Time per output token measures how fast the rest of the answer arrives.",
    "Goodput is the highest request rate at which most requests meet both latency targets.",
    "A router takes requests, picks instances, and streams tokens back to every client.",
    "Continuous batching lets new sequences join while others are still decoding.",
    "Chunked prefill splits a long prompt so that decoding never stalls for long.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Le café est très chaud, et la crème brûlée est délicieuse à Noël.",
    "我们在服务器上生成文本，每一个字都很重要。",
    "Emoji travel far: 🙂 🚀 🎉 ✨ and they take four bytes each.",
    "Numbers 0123456789 and symbols !?.,;:()[]{} appear in code and prose alike.",
]
DEMO_PROMPTS = [
    "Disaggregated serving splits",
    "The decode instance receives",
    "Time to first token measures how long",
    "A router takes requests,",
    "Chunked prefill splits a long prompt so that",
    "Goodput is the highest request rate",
]


def train_tokenizer(corpus: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with <unk>=0, <s>=1 (BOS, prepended) and </s>=2 (EOS)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 3, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, model_dir: Path, model_max_length: int) -> None:
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_demo_model(out_dir: Path) -> None:
    """The demo model and its tokenizer, saved into `out_dir` (the tokenizer last)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(_CORPUS, DEMO_VOCAB_SIZE)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _fit_to_corpus(model, tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir, config.max_position_embeddings)


def _fit_to_corpus(model: object, tokenizer: Tokenizer, num_steps: int = 100) -> None:
    """A few seconds of full-batch Adam on the corpus (each sentence ends with EOS)."""
    import torch

    encoded = [tokenizer.encode(text).ids + [2] for text in _CORPUS]
    max_len = max(len(ids) for ids in encoded)
    input_ids = torch.zeros(len(encoded), max_len, dtype=torch.long)
    labels = torch.full((len(encoded), max_len), -100, dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)  # type: ignore[attr-defined]
    model.train()  # type: ignore[attr-defined]
    for _ in range(num_steps):
        loss = model(input_ids=input_ids, labels=labels).loss  # type: ignore[operator]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()  # type: ignore[attr-defined]
