"""Tool calls on chat completions: what the model writes, turned into OpenAI's `message.tool_calls`.

Three modes, as vLLM's OpenAI server has them:
- `auto`: the model writes calls in its family's format, parsed out of its text: Hermes / Qwen
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text, or Llama 3's JSON
  (the whole output one `{"name": ..., "parameters": {...}}` object, optionally after `<|python_tag|>`, or
  several separated by `;`). Text that is not a call stays content.
- `required`: a JSON array of one or more `{"name", "parameters"}` objects, enforced by the structured-output
  grammar (each item valid against its tool's parameters).
- a named function: the output is that function's arguments, enforced by its parameters' schema.
"""

from __future__ import annotations

import json
import re
import uuid

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


def required_schema(tools: list[dict]) -> dict:
    """The JSON schema of a `required` answer: an array of calls, each of some tool with valid arguments."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                          "parameters": t["function"].get("parameters") or {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}


def call(name: str, arguments) -> dict:
    """One OpenAI tool call (arguments as a JSON string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _as_call(obj, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return call(obj["name"], args) if isinstance(args, (dict, str)) else None


def parse(text: str, mode, tools: list[dict]) -> tuple[str, list[dict]]:
    """(content, tool calls) of a finished choice's text under tool_choice `mode` ("auto", "required" or a
    function name). A call naming no given tool, or malformed, stays text."""
    names = {t["function"]["name"] for t in tools}
    if mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        calls = [_as_call(x, names) for x in items] if isinstance(items, list) else []
        return ("", calls) if calls and all(calls) else (text, [])
    if mode != "auto":  # a named function: the text is its arguments
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return "", [call(mode, text)]
    calls, content = [], text
    for m in CALL.finditer(text):
        try:
            c = _as_call(json.loads(m.group(1)), names)
        except ValueError:
            c = None
        if c is not None:
            calls.append(c)
            content = content.replace(m.group(0), "", 1)
    if calls:
        return content, calls
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if body.startswith("{"):  # Llama 3: the whole output is the call(s)
        try:
            found = [_as_call(json.loads(part), names) for part in body.split(";") if part.strip()]
        except ValueError:
            found = []
        if found and all(found):
            return "", found
    return text, []


def held(text: str, mode) -> int:
    """How much of a streaming choice's text may go out as content now: under `auto`, none once it may be a
    Llama 3 call (it starts with `{` or the python tag), else the text before a Hermes call or a prefix of
    one; under `required` or a named function, none (the text is the call)."""
    if mode != "auto":
        return 0
    stripped = text.lstrip()
    if stripped.startswith("{") or PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)]) and stripped:
        return 0
    i = text.find(OPEN)
    if i >= 0:
        return i
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):  # a tag cut in half at the end
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return len(text)
