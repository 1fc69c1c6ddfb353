"""Reading tool calls out of text: the pieces every format of ``tool_parsers`` is made of
(where a marker begins, a JSON object, a call of a name and its arguments, a list of Python
keyword calls, an argument typed by its schema). Pure functions of text."""

from __future__ import annotations

import ast
import json

Call = tuple[str, str]  # (function name, arguments as JSON text)


def find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, bool] | None:
    """Where the first of ``markers`` begins, or else where one's cut-off prefix ends ``text``."""
    found = [at for at in map(text.find, markers) if at >= 0]
    if found:
        return min(found), True
    cuts = [cut for cut in (cut_marker(text, m) for m in markers) if cut is not None]
    return (min(cuts), False) if cuts else None


def first_start(*found: tuple[int, bool] | None) -> tuple[int, bool] | None:
    """The first complete start among ``found``, or else the first cut-off one."""
    starts = [f for f in found if f is not None]
    complete = [at for at, is_complete in starts if is_complete]
    if complete:
        return min(complete), True
    return (min(at for at, _ in starts), False) if starts else None


def cut_marker(text: str, marker: str) -> int | None:
    """Where a proper prefix of ``marker`` that ends ``text`` begins (the longest one)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return None


def json_object(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def read_call(obj, *argument_keys: str) -> Call | None:
    """(name, arguments JSON) of ``{"name": ..., <argument key>: {...}}``; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def named_call(name: str, arguments: str) -> Call | None:
    """(name, arguments JSON) of a name and a JSON object written apart; None if not those."""
    name = name.strip()
    return read_call({"name": name, "arguments": json_object(arguments)}, "arguments") if name \
        else None


def json_calls(items) -> list[Call]:
    """The calls of a JSON list of ``{"name", "arguments"}``; none if it is anything else."""
    if not isinstance(items, list):
        return []
    calls = [read_call(item, "arguments") for item in items]
    return [] if None in calls else calls


def python_calls(node: ast.expr, json_names: bool = False) -> list[Call]:
    """The calls of a list of ``name(keyword=literal, ...)`` (JSON's ``null``, ``true`` and
    ``false`` among the literals with ``json_names``); none if it is anything else."""
    if not isinstance(node, ast.List):
        return []
    calls = []
    for call in node.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args \
                or any(k.arg is None for k in call.keywords):  # (positional, **kwargs)
            return []
        arguments = {k.arg: ast.literal_eval(_JsonNames().visit(k.value) if json_names else
                                             k.value) for k in call.keywords}
        calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


class _JsonNames(ast.NodeTransformer):
    """JSON's ``null``, ``true`` and ``false``, written where Python's literals go, as those."""

    _VALUES = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self._VALUES[node.id]) if node.id in self._VALUES else node


def typed(text: str, schema: dict | None):
    """An argument written as bare text, as its schema types it: a string parameter's text (one
    newline either side is the format's), a number, a boolean, JSON or a Python literal for the
    rest, ``null`` as None; text that is not what its type says stays text."""
    text = text.removeprefix("\n").removesuffix("\n")
    types = (schema or {}).get("type", "string")
    types = set(types) if isinstance(types, list) else {types}
    if text.strip().lower() == "null" and "string" not in types:
        return None
    if "string" in types:
        return text
    value = text.strip()
    if types & {"integer", "number"}:
        try:
            number = json.loads(value)
        except ValueError:
            return text
        return number if isinstance(number, (int, float)) and not isinstance(number, bool) \
            else text
    if "boolean" in types:
        return {"true": True, "false": False}.get(value.lower(), text)
    try:
        return json.loads(value)
    except ValueError:
        try:
            return ast.literal_eval(value)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return text


def skip(text: str, at: int, chars: str) -> int:
    """Where ``text`` goes on after the run of ``chars`` at ``at``."""
    while at < len(text) and text[at] in chars:
        at += 1
    return at
