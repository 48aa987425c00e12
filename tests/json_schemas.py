"""Random JSON schemas for structured-output tests: nested objects, arrays, enums, bounded numbers
and strings, required fields. Every part is bounded, so any output the grammar allows ends."""

from __future__ import annotations

import random

_WORDS = ["name", "id", "city", "tags", "price", "count", "kind", "user", "items", "ok", "score", "note"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "null"] + (["array", "object", "object"] if depth < 3 else [])
    kind = rng.choice(kinds if depth else ["object"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 10)}
    if kind == "integer":
        low = rng.randint(-1000, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number", "minimum": -100, "maximum": 100}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None, "a b"], rng.randint(1, 4))}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    names = rng.sample(_WORDS, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: random_schema(rng, depth + 1) for name in names},
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


def random_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
