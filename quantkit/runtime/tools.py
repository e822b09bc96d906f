"""Tool calls on chat completions: what the model writes, turned into OpenAI's `message.tool_calls`.

Three modes, as vLLM's OpenAI server has them:
- `auto`: the model writes calls in its family's format, parsed out of its text: Hermes / Qwen
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text, Gemma 4's
  `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42}<tool_call|>` blocks (unquoted keys, strings between
  `<|"|>` marks), or Llama 3's JSON (the whole output one `{"name": ..., "parameters": {...}}` object,
  optionally after `<|python_tag|>`, or several separated by `;`). Text that is not a call stays content.
  (gpt-oss's harmony calls are read from its channels: tokenizer.Channels.)
- `required`: a JSON array of one or more `{"name", "parameters"}` objects, enforced by the structured-output
  grammar (each item valid against its tool's parameters).
- a named function: the output is that function's arguments, enforced by its parameters' schema.
"""

from __future__ import annotations

import json
import re
import uuid

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
GEMMA = re.compile(r"<\|tool_call>call:([\w.\-]+)(\{.*?\})<tool_call\|>", re.S)
OPENS = ("<tool_call>", "<|tool_call>")
PYTHON_TAG = "<|python_tag|>"
QUOTE = '<|"|>'  # Gemma 4's string delimiter


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
    found = []  # (position, call, its text)
    for m in CALL.finditer(text):
        try:
            found.append((m.start(), _as_call(json.loads(m.group(1)), names), m.group(0)))
        except ValueError:
            pass
    for m in GEMMA.finditer(text):
        try:
            args, end = _gemma_value(m.group(2), 0)
            found.append((m.start(), call(m.group(1), args) if m.group(1) in names and end == len(m.group(2))
                          and isinstance(args, dict) else None, m.group(0)))
        except (ValueError, IndexError):
            pass
    calls, content = [], text
    for _, c, block in sorted(found, key=lambda f: f[0]):
        if c is not None:
            calls.append(c)
            content = content.replace(block, "", 1)
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
    if stripped.startswith("{") or (stripped and PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)])):
        return 0
    found = [i for i in (text.find(o) for o in OPENS) if i >= 0]
    if found:
        return min(found)
    for k in range(min(max(map(len, OPENS)) - 1, len(text)), 0, -1):  # a tag cut in half at the end
        if any(text.endswith(o[:k]) for o in OPENS):
            return len(text) - k
    return len(text)


def _gemma_value(s: str, i: int):
    """(value, end) of the Gemma 4 value at s[i:]: a `<|"|>` string, an object of unquoted keys, a list, or
    a bare literal (a JSON number, true, false, null; else its text)."""
    if s.startswith(QUOTE, i):
        j = s.index(QUOTE, i + len(QUOTE))
        return s[i + len(QUOTE):j], j + len(QUOTE)
    if s[i] in "{[":
        close, out, i = "}]"["{[".index(s[i])], {} if s[i] == "{" else [], i + 1
        while s[i] != close:
            if isinstance(out, dict):
                colon = s.index(":", i)
                key = s[i:colon].strip()
                out[key], i = _gemma_value(s, colon + 1)
            else:
                value, i = _gemma_value(s, i)
                out.append(value)
            if s[i] == ",":
                i += 1
            elif s[i] != close:
                raise ValueError(f"expected , or {close}")
        return out, i + 1
    m = re.compile(r"[^,}\]]*").match(s, i)
    word = m.group(0).strip()
    try:
        return json.loads(word), m.end()
    except ValueError:
        return word, m.end()
