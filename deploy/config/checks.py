"""The serve config's value checks: each raises ConfigError with the key's dotted name, what it
must be, and what it was."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file or flag the user must fix; the message says what and how."""


def check_int(where: str, name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}.{name} must be an integer >= {minimum}, got {value!r}")


def check_bool(where: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name} must be true or false, got {value!r}")


def check_seconds(where: str, name: str, value: Any, allow_zero: bool = False) -> None:
    if not (is_amount(value) or (allow_zero and value == 0 and not isinstance(value, bool))):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{where}.{name} must be a number of seconds {bound}, got {value!r}")


def is_amount(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def check_choice(where: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{where}.{name} must be one of {', '.join(choices)}; got {value!r}")


def check_file(where: str, name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not Path(value).expanduser().is_file():
        raise ConfigError(
            f"{where}.{name}: {value!r} is not a file; give the path to an existing one"
        )
