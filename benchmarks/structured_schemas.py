"""The schema suite of benchmarks/structured_output.py: JSON schemas made here, deterministic.

    schemas(count=200, seed=0) -> list of (topic, schema)

Each schema is an object about one topic, built from the shapes real applications send:
bounded strings, enums, integers and numbers with ranges, booleans, string formats (date,
date-time, uuid, ipv4) and patterns (an email address among them), arrays with item bounds, nested objects, anyOf
unions, const values, and a mix of required and optional fields. Strings and arrays carry
bounds, as a schema meant for a model should: an unbounded one lets a small model run on until
max_tokens.
"""

from __future__ import annotations

import json
import random
from typing import Any

TOPICS = [
    "book",
    "city",
    "recipe",
    "movie",
    "planet",
    "song",
    "car",
    "user account",
    "invoice",
    "flight",
    "hotel stay",
    "weather report",
    "sports match",
    "job offer",
    "product review",
    "bank transfer",
    "museum",
    "restaurant order",
    "train ticket",
    "medical appointment",
]
WORDS = ["name", "title", "label", "owner", "place", "color", "status", "kind", "note", "code"]
# Formats whose strings have a bounded length; `email` has none (a 135M model repeats itself
# inside one until max_tokens), so an address is a bounded pattern here.
FORMATS = ["date", "date-time", "uuid", "ipv4"]
PATTERNS = [
    r"^[A-Z]{3}-[0-9]{3}$",
    r"^[a-z]{1,12}(-[a-z]{1,12})?$",
    r"^\+?[0-9]{6,10}$",
    r"^v[0-9]\.[0-9]$",
    r"^[a-z0-9.]{1,16}@[a-z]{1,12}\.(com|org|net)$",
]
Schema = dict[str, Any]


def _leaf(rng: random.Random) -> Schema:
    kind = rng.choice(
        ["string", "enum", "integer", "number", "boolean", "format", "pattern", "const"]
    )
    if kind == "string":
        return {
            "type": "string",
            "minLength": rng.choice([0, 1, 2]),
            "maxLength": rng.choice([8, 16, 24]),
        }
    if kind == "enum":
        return {
            "enum": rng.sample(
                ["red", "green", "blue", "small", "large", "open", "closed", "new"], 3
            )
        }
    if kind == "integer":
        low = rng.choice([0, 1, -10, 1900])
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([9, 100, 1000])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 5000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    return {"const": rng.choice(["v1", "ok", 1, True])}


def _value(rng: random.Random, depth: int) -> Schema:
    roll = rng.random()
    if depth < 2 and roll < 0.15:
        return _object(rng, depth + 1, rng.randint(1, 3))
    if roll < 0.30:
        low = rng.choice([0, 1])
        return {
            "type": "array",
            "items": _leaf(rng) if depth else _value(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.choice([1, 2, 3]),
        }
    if roll < 0.40:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _leaf(rng)


def _object(rng: random.Random, depth: int, num_fields: int) -> Schema:
    names = rng.sample(WORDS, num_fields)
    properties = {name: _value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def schemas(count: int = 200, seed: int = 0) -> list[tuple[str, Schema]]:
    """`count` distinct schemas, each with its topic."""
    rng = random.Random(seed)
    seen: set[str] = set()
    suite: list[tuple[str, Schema]] = []
    while len(suite) < count:
        schema = _object(rng, 0, rng.randint(1, 5))
        key = json.dumps(schema, sort_keys=True)
        if key not in seen:
            seen.add(key)
            suite.append((TOPICS[len(suite) % len(TOPICS)], schema))
    return suite
