"""``response_format`` as a llama.cpp grammar: JSON (any object) or a JSON schema, so that the output always
parses and, for a schema, validates.

The schema is turned into GBNF by llama-cpp-python's converter. A schema keyword the converter does not
enforce (``minimum``, ``uniqueItems``...) would let invalid output through, so it is refused by name, never
ignored; annotations (``title``, ``description``...) change nothing and pass.
"""

from __future__ import annotations

import json
import re

from .errors import ApiError

# The converter takes one branch per schema (its order: $ref, anyOf/oneOf, a list of types, const, enum, an
# object's properties, allOf, an array's items, a string's pattern, format or length, a bare type) and uses
# only that branch's keywords: any other constraint beside them would be dropped, so it is refused.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions", "discriminator"})
FORMATS = frozenset({"date", "time", "date-time", "uuid"})  # the string formats the converter has rules for
NESTED = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
NESTED_LISTS = ("anyOf", "oneOf", "prefixItems")  # keyword -> [schema]
ALL_OF_PARTS = frozenset({"type", "properties", "required", "$ref", "anyOf"}) | ANNOTATIONS
# a pattern the converter turns into grammar faithfully: no escapes, negated classes or quotes
SAFE_PATTERN = re.compile(r"[\^$\w .,:;!?@#%&*+={}()\[\]|<>/'~-]*")


def _branch(schema: dict) -> frozenset[str]:
    """The keywords the converter's branch for ``schema`` turns into grammar."""
    kind = schema.get("type")
    if "$ref" in schema:
        return frozenset({"$ref"})
    if "oneOf" in schema or "anyOf" in schema:
        return frozenset({"oneOf", "anyOf"})
    if isinstance(kind, list):
        return frozenset({"type"})
    if "const" in schema:
        return frozenset({"type", "const"})
    if "enum" in schema:
        return frozenset({"type", "enum"})
    if kind in (None, "object") and ("properties" in schema or schema.get("additionalProperties", True) is not True):
        return frozenset({"type", "properties", "required", "additionalProperties"})
    if kind in (None, "object") and "allOf" in schema:
        return frozenset({"type", "allOf"})
    if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
        return frozenset({"type", "items", "minItems", "maxItems"} if isinstance(schema.get("items"), dict)
                         else {"type", "items", "prefixItems"})
    if kind in (None, "string") and "pattern" in schema:
        return frozenset({"type", "pattern"})
    if kind in (None, "string") and "format" in schema:
        return frozenset({"type", "format"})
    if kind == "string":
        return frozenset({"type", "minLength", "maxLength"})
    return frozenset({"type"})


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
    for wrong, right in STRING_FIXES:
        gbnf = gbnf.replace(wrong, right)
    return gbnf


# llama-cpp-python's converter lets raw control characters into strings (and quotes and backslashes through a
# pattern's "."), which JSON forbids: its "char" and "dot" rules, as llama.cpp's own JSON grammar writes them
STRING_FIXES = ((r'char ::= [^"\\] |', r'char ::= [^"\\\x7F\x00-\x1F] |'),
                (r"dot ::= [^\x0A\x0D]", r'dot ::= [^"\\\x7F\x00-\x1F]'))


def _unenforced(schema: object, where: str) -> set[str]:
    """Every keyword under ``schema`` the grammar would not enforce, named by its path."""
    if isinstance(schema, bool):
        return set()
    if not isinstance(schema, dict):
        return {f"{where} (not an object)"}
    found = {f"{where}.{k}" for k in schema if k not in ANNOTATIONS and k not in _branch(schema)}
    if "format" in schema and schema["format"] not in FORMATS:
        found.add(f"{where}.format={schema['format']}")
    if isinstance(schema.get("$ref"), str) and not schema["$ref"].startswith("#/"):
        found.add(f"{where}.$ref={schema['$ref']} (only local references)")
    if "pattern" in schema and not (isinstance(schema["pattern"], str) and SAFE_PATTERN.fullmatch(schema["pattern"])
                                    and "[^" not in schema["pattern"]):
        found.add(f"{where}.pattern (escapes, negated classes and quotes)")
    for i, part in enumerate(schema.get("allOf") or []):  # the converter reads each part's properties only
        if isinstance(part, dict):
            found |= {f"{where}.allOf[{i}].{k}" for k in part if k not in ALL_OF_PARTS}
            for name, s in (part.get("properties") or {}).items():
                found |= _unenforced(s, f"{where}.allOf[{i}].properties.{name}")
    for key in NESTED:
        sub = schema.get(key, {})
        if not isinstance(sub, dict):
            found.add(f"{where}.{key} (not an object)")
            continue
        for name, s in sub.items():
            found |= _unenforced(s, f"{where}.{key}.{name}")
    for key in (*NESTED_LISTS, "items"):
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                found |= _unenforced(s, f"{where}.{key}[{i}]")
        elif key == "items" and sub is not None:
            found |= _unenforced(sub, f"{where}.items")
    if isinstance(schema.get("additionalProperties"), dict):
        found |= _unenforced(schema["additionalProperties"], f"{where}.additionalProperties")
    return found
