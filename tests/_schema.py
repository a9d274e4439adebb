"""A small JSON Schema checker: the keywords docs/snapshot-header.schema.json uses, no more.

``type``, ``const``, ``enum``, ``required``, ``properties``, ``additionalProperties: false``,
``items``, ``prefixItems``, ``minItems``, ``maxItems``, ``minimum``, ``pattern``, ``oneOf`` and
local ``$ref``. A keyword it does not know fails the check, so the schema cannot outgrow it.
"""

from __future__ import annotations

import re
from typing import Any

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}
_KNOWN = {
    "$schema", "$id", "$defs", "$ref", "title", "description", "type", "const", "enum",
    "required", "properties", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "minimum", "pattern", "oneOf",
}  # fmt: skip


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return type(value) is int
    if kind == "number":
        return type(value) in (int, float)
    return isinstance(value, _TYPES[kind]) and not (kind != "boolean" and type(value) is bool)


def errors(
    schema: dict[str, Any], value: Any, root: dict[str, Any] | None = None, at: str = "$"
) -> list[str]:
    """Where ``value`` breaks ``schema``, one line each; empty when it follows it."""
    root = schema if root is None else root
    unknown = set(schema) - _KNOWN
    if unknown:
        return [f"{at}: the checker does not know {sorted(unknown)}"]
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return errors(target, value, root, at)
    found: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, kind) for kind in kinds):
            return [f"{at}: {value!r} is not {' or '.join(kinds)}"]
    if "const" in schema and value != schema["const"]:
        found.append(f"{at}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{at}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        found.append(f"{at}: {value} < {schema['minimum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        found.append(f"{at}: {value!r} does not match {schema['pattern']}")
    if "oneOf" in schema:
        matching = [option for option in schema["oneOf"] if not errors(option, value, root, at)]
        if len(matching) != 1:
            found.append(f"{at}: {value!r} matches {len(matching)} of the oneOf options")
    if isinstance(value, dict):
        found += [
            f"{at}: missing {key!r}" for key in schema.get("required", ()) if key not in value
        ]
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                found += errors(properties[key], item, root, f"{at}.{key}")
            elif schema.get("additionalProperties") is False:
                found.append(f"{at}: {key!r} is not allowed")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get(
            "maxItems", len(value)
        ):
            found.append(f"{at}: {len(value)} items")
        prefix = schema.get("prefixItems", [])
        for index, item in enumerate(value):
            where = f"{at}[{index}]"
            if index < len(prefix):
                found += errors(prefix[index], item, root, where)
            elif "items" in schema:
                found += errors(schema["items"], item, root, where)
    return found
