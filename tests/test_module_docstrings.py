"""Every tracked Python module opens with a docstring of at most 30 lines: the reasoning behind a
module lives in docs/design/, and the docstring says what the module does and points there."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 30


def tracked_python_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / name for name in out.split()]


def test_every_module_docstring_is_at_most_30_lines() -> None:
    files = tracked_python_files()
    assert files, "git ls-files found no Python files"
    too_long = {}
    for path in files:
        if not path.exists():  # deleted in the working tree, not yet committed
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)))
        if docstring is not None and len(docstring.splitlines()) > MAX_LINES:
            too_long[str(path.relative_to(ROOT))] = len(docstring.splitlines())
    assert not too_long, f"module docstrings over {MAX_LINES} lines: {too_long}"
