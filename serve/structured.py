"""``response_format`` as a llama.cpp grammar: JSON (any object) or a JSON schema, so that the output always
parses and, for a schema, validates.

The schema is turned into GBNF by llama-cpp-python's converter. A schema keyword the converter does not
enforce (``minimum``, ``uniqueItems``...) would let invalid output through, so it is refused by name, never
ignored; annotations (``title``, ``description``...) change nothing and pass.
"""

from __future__ import annotations

import json

from .errors import ApiError

# keywords the grammar enforces, and annotations that constrain nothing
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern", "minLength",
    "maxLength", "format"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly"})
FORMATS = frozenset({"date", "time", "date-time", "uuid"})  # the string formats the converter has rules for
NESTED = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
NESTED_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keyword -> [schema]


def grammar_for(response_format: object) -> str | None:
    """The GBNF grammar of an OpenAI ``response_format`` (None for plain text); a bad one is a 400."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ApiError("'response_format' must be an object like {\"type\": \"json_object\"}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        from llama_cpp.llama_grammar import JSON_GBNF

        return JSON_GBNF
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError("'response_format.json_schema.schema' must be a JSON schema object")
        return schema_grammar(schema)
    raise ApiError(f"'response_format.type' {kind!r} is not one of text, json_object, json_schema")


def schema_grammar(schema: dict) -> str:
    """GBNF for ``schema`` (root rule ``root``), after refusing what the grammar would not enforce."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    unenforced = sorted(_unenforced(schema, "schema"))
    if unenforced:
        raise ApiError(f"JSON schema keyword(s) {', '.join(unenforced)} cannot be enforced by the llama.cpp "
                       "grammar", "drop them, or serve with --engine vllm")
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - the converter's own complaint about the schema
        raise ApiError(f"the JSON schema cannot be turned into a grammar: {e}") from None
    return gbnf.replace(*STRING_CHAR_FIX)


# llama-cpp-python's converter lets raw control characters into strings, which JSON forbids (llama.cpp's own
# converter and its JSON grammar exclude them)
STRING_CHAR_FIX = (r'char ::= [^"\\] |', r'char ::= [^"\\\x7F\x00-\x1F] |')


def _unenforced(schema: object, where: str) -> set[str]:
    if isinstance(schema, bool):
        return set()
    if not isinstance(schema, dict):
        return {f"{where} (not an object)"}
    found = {f"{where}.{k}" for k in schema if k not in ENFORCED and k not in ANNOTATIONS}
    if "format" in schema and schema["format"] not in FORMATS:
        found.add(f"{where}.format={schema['format']}")
    if isinstance(schema.get("$ref"), str) and not schema["$ref"].startswith("#"):
        found.add(f"{where}.$ref={schema['$ref']} (only local references)")
    for key in NESTED:
        for name, sub in (schema.get(key) or {}).items():
            found |= _unenforced(sub, f"{where}.{key}.{name}")
    for key in NESTED_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            found |= _unenforced(sub, f"{where}.{key}[{i}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found |= _unenforced(schema[key], f"{where}.{key}")
    return found
