"""How a benchmark script hands over its result: one JSON object as the last line printed, and
the same object (indented) in the --out file when one is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: str | Path | None) -> None:
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)
