"""A tiny byte-level BPE tokenizer with a chat template, saved into a tiny model's folder.

    add_tiny_tokenizer(model_dir) -> model_dir

Trained (with deploy.config.demo_model's trainer) on a few sentences in English, French, Chinese and
emoji, so multi-byte UTF-8 characters span several tokens and some tokens end in the middle of a
character: the cases incremental detokenizing must get right. The vocabulary has exactly the tiny
models' 512 ids, with <unk>=0, <s>=1 (BOS, prepended to every encoding) and </s>=2 (EOS),
matching tests/tiny_models.py.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from deploy.config.demo_model import SPECIAL_TOKENS, save_tokenizer, train_tokenizer

VOCAB_SIZE = 512
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
    return train_tokenizer(_CORPUS, VOCAB_SIZE)


def add_tiny_tokenizer(model_dir: str | Path) -> str:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into `model_dir`."""
    model_dir = Path(model_dir)
    tokenizer = train_tiny_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    save_tokenizer(tokenizer, model_dir, model_max_length=512)
    return str(model_dir)
