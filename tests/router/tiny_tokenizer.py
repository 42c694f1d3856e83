"""A tiny byte-level BPE tokenizer with a chat template, saved into a tiny model's folder.

    add_tiny_tokenizer(model_dir) -> model_dir

Trained on a few sentences in English, French, Chinese and emoji, so multi-byte UTF-8 characters
span several tokens and some tokens end in the middle of a character: the cases incremental
detokenizing must get right. The vocabulary has exactly the tiny models' 512 ids, with
<unk>=0, <s>=1 (BOS, prepended to every encoding) and </s>=2 (EOS), matching tests/tiny_models.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A router streams tokens to many clients; each client reads its own stream.",
    "Prefill computes the prompt, decode generates one token at a time, step by step.",
    "Le café est très chaud, et la crème brûlée est délicieuse à Noël.",
    "Où est la bibliothèque? Près de l'école, à côté du théâtre.",
    "我们在服务器上生成文本，每一个字都很重要。",
    "今天天气很好，我们去公园散步吧。",
    "Emoji travel far: 🙂 🚀 🎉 ✨ and they take four bytes each 🙂🚀.",
    'Numbers 0123456789, symbols !@#$%^&*()_+-=[]{}|;:\',.<>/? and quotes "like this".',
    "user assistant system: hello, how are you today? I am fine, thank you very much.",
]


def train_tiny_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 3, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tokenizer


def add_tiny_tokenizer(model_dir: str | Path) -> str:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into `model_dir`."""
    model_dir = Path(model_dir)
    tokenizer = train_tiny_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return str(model_dir)
