"""The serve config's knobs: a dataclass field whose metadata holds the check of its value.

    block_size: int = knob(16, integer(1))

A check gets the key's dotted name and the value; it raises ConfigError with that name, what the
value must be, and what it was. ServeConfig runs every knob's check on construction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

Check = Callable[[str, Any], None]


class ConfigError(ValueError):
    """A config file or flag the user must fix; the message says what and how."""


def knob(default: Any, check: Check) -> Any:
    """A config field: its default and its check. A dict default is copied per instance."""
    if isinstance(default, dict):
        return dataclasses.field(default_factory=dict, metadata={"check": check})
    return dataclasses.field(default=default, metadata={"check": check})


def rule(ok: Callable[[Any], object], message: str, optional: bool = False) -> Check:
    """A check from a test; `message` is formatted with the key and the value (`optional`: None
    passes)."""

    def check(key: str, value: Any) -> None:
        if not (optional and value is None) and not ok(value):
            raise ConfigError(message.format(key=key, value=value))

    return check


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_amount(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def integer(minimum: int, optional: bool = False) -> Check:
    must = f"{{key}} must be an integer >= {minimum}, got {{value!r}}"
    return rule(lambda value: is_int(value) and value >= minimum, must, optional)


def seconds(allow_zero: bool = False) -> Check:
    bound = ">= 0" if allow_zero else "> 0"
    return rule(
        lambda value: (
            is_amount(value) or (allow_zero and value == 0 and not isinstance(value, bool))
        ),
        f"{{key}} must be a number of seconds {bound}, got {{value!r}}",
    )


def choice(choices: tuple[str, ...]) -> Check:
    must = f"{{key}} must be one of {', '.join(choices)}; got {{value!r}}"
    return rule(lambda value: value in choices, must)


boolean = rule(lambda value: isinstance(value, bool), "{key} must be true or false, got {value!r}")
port_number = rule(
    lambda value: is_int(value) and 0 <= value <= 65535,
    "{key} must be a port in [0, 65535], got {value!r}",
    optional=True,
)
address = rule(
    lambda value: isinstance(value, str) and value,
    "{key} must be an address such as 127.0.0.1, got {value!r}",
)
ray_address = rule(
    lambda value: isinstance(value, str) and value,
    "{key} must be 'auto', 'HOST:PORT' or null, got {value!r}",
    optional=True,
)
cpu_or_cuda = rule(
    lambda value: value == "cpu" or (isinstance(value, str) and value.startswith("cuda")),
    "{key} must be 'cpu' or 'cuda', got {value!r}",
)
token = rule(
    lambda value: isinstance(value, str) and value.strip(),
    "{key} must be a non-empty string (or null for no auth)",
    optional=True,
)
optional_text = rule(
    lambda value: isinstance(value, str) and value.strip(),
    "{key} must be a non-empty string (or null), got {value!r}",
    optional=True,
)
amount = rule(is_amount, "{key} must be a number > 0, got {value!r}", optional=True)
file = rule(
    lambda value: isinstance(value, str) and Path(value).expanduser().is_file(),
    "{key}: {value!r} is not a file; give the path to an existing one",
    optional=True,
)


def resources(key: str, value: Any) -> None:
    """Custom Ray resources: a mapping of names to amounts > 0."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must map resource names to amounts: {value!r}")
    for name, quantity in value.items():
        if not isinstance(name, str) or not is_amount(quantity):
            raise ConfigError(f"{key}[{name!r}] must be a number > 0, got {quantity!r}")


def read_token_file(path: str, what: str) -> str:
    """The bearer token in a file (its text, stripped), which must not be empty."""
    text = Path(path).expanduser().read_text().strip()
    if not text:
        raise ConfigError(f"{what} {path!r} is empty")
    return text
