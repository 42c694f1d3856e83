"""A layer-skip self-draft: some decoder layers of a model (the first N, or a chosen list such as
the first and last few), with its embeddings, final norm and head, saved as a Hugging Face
folder that `speculative.draft_model` accepts.

It shares the target's tokenizer by construction (the tokenizer files are copied) and needs no
download. What limits it: its layers were trained to feed the layers it drops, not the final
norm and head, so its proposals agree with the target less often than those of a model trained
as a draft (or distilled from the target); and it is still a slice of the target, so a draft
token costs N / L of a target decode step's weight reads (L the target's layers).

    python -m engine.speculative.layer_skip SOURCE_DIR OUT_DIR --layers 6
    python -m engine.speculative.layer_skip SOURCE_DIR OUT_DIR --keep 0,1,2,3,26,27,28,29
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Sequence
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


def build_layer_skip_draft(
    source: str | Path, out: str | Path, num_layers: int = 0, keep: Sequence[int] = ()
) -> str:
    """Write the draft folder `out` from the model folder `source`: its layers `keep` (source
    indices, ascending), or else its first `num_layers`; returns `out`."""
    source, out = Path(source), Path(out)
    config = json.loads((source / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    kept = list(keep) or list(range(num_layers))
    if (
        not 1 <= len(kept) < total
        or kept != sorted(set(kept))
        or not 0 <= kept[0] <= kept[-1] < total
    ):
        raise ValueError(f"a layer-skip draft keeps 1 to {total - 1} of {total} layers, ascending")
    new_index = {old: new for new, old in enumerate(kept)}
    config["num_hidden_layers"] = len(kept)
    if isinstance(config.get("layer_types"), list):  # per-layer attention, where the family has it
        config["layer_types"] = [config["layer_types"][i] for i in kept]
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in checkpoint_files(source):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                match = _LAYER.match(name)
                if match is None:
                    tensors[name] = f.get_tensor(name)
                elif int(match.group(2)) in new_index:
                    index = new_index[int(match.group(2))]
                    renamed = f"{match.group(1) or ''}layers.{index}.{name[match.end() :]}"
                    tensors[renamed] = f.get_tensor(name)
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
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers")
    parser.add_argument("--keep", default="", help="comma-separated layer indices to keep")
    args = parser.parse_args(argv)
    keep = [int(i) for i in args.keep.split(",") if i]
    print(build_layer_skip_draft(args.source, args.out, args.layers, keep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
