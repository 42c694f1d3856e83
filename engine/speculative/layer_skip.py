"""A layer-skip self-draft: the first N decoder layers of a model, with its embeddings, final norm
and head, saved as a Hugging Face folder that `speculative.draft_model` accepts.

It shares the target's tokenizer by construction (the tokenizer files are copied) and needs no
download. What limits it: its layers were trained to feed the layers it drops, not the final
norm and head, so its proposals agree with the target less often than those of a model trained
as a draft (or distilled from the target); and it is still a slice of the target, so a draft
token costs N / L of a target decode step's weight reads (L the target's layers).

    python -m engine.speculative.layer_skip SOURCE_DIR OUT_DIR --layers 6
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader import checkpoint_files

_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.")
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def build_layer_skip_draft(source: str | Path, out: str | Path, num_layers: int) -> str:
    """Write the draft folder `out` from the model folder `source`; returns `out`."""
    source, out = Path(source), Path(out)
    config = json.loads((source / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"a layer-skip draft keeps 1 to {total - 1} of {total} layers")
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention, where the family has it
        config["layer_types"] = config["layer_types"][:num_layers]
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in checkpoint_files(source):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                match = _LAYER.match(name)
                if match is None or int(match.group(2)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in _COPIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, required=True)
    args = parser.parse_args(argv)
    print(build_layer_skip_draft(args.source, args.out, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
