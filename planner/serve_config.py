"""A plan as a `pdserve serve --config` file (deploy/config/serve_config.py's schema, written as YAML).

pdserve has no pipeline parallelism: a placement with pp > 1 cannot be served and is refused
with a message that says to plan with pp 1 only. Keys other than the layout (model, device,
KV cache, scheduler, router) come from `base`, a mapping in the same schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from planner.placement import Parallel, Placement


def _section(par: Parallel, role: str) -> dict[str, Any]:
    if par.pp != 1:
        raise ValueError(
            f"the plan's {role} uses pp={par.pp}, but pdserve serves pp=1 only; "
            "plan with --pp 1 to write a config"
        )
    return {"instances": par.count, "tensor_parallel_size": par.tp}


def serve_config_dict(placement: Placement, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config mapping for `placement`, over `base` (which it does not change)."""
    data: dict[str, Any] = {
        k: (dict(v) if isinstance(v, dict) else v) for k, v in (base or {}).items()
    }
    data["mode"] = placement.layout
    if placement.colocated is not None:
        data["colocated"] = {
            **data.get("colocated", {}),
            **_section(placement.colocated, "colocated"),
        }
    else:
        assert placement.prefill is not None and placement.decode is not None
        data["prefill"] = {**data.get("prefill", {}), **_section(placement.prefill, "prefill")}
        data["decode"] = {**data.get("decode", {}), **_section(placement.decode, "decode")}
    return data


def write_serve_config(
    path: str | Path, placement: Placement, base: dict[str, Any] | None = None, comment: str = ""
) -> None:
    header = "".join(f"# {line}\n" for line in comment.splitlines()) if comment else ""
    body = yaml.safe_dump(serve_config_dict(placement, base), sort_keys=False)
    Path(path).write_text(header + body, encoding="utf-8")
