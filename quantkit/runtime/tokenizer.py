"""Text <-> tokens with the `tokenizers` library, and chat templates from tokenizer_config.json (jinja2,
sandboxed: a checkpoint's template is untrusted input)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from quantkit.errors import InvalidInput


class TextCodec:
    """The checkpoint's tokenizer.json plus the special tokens and chat template of tokenizer_config.json."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise InvalidInput(f"{path}: no tokenizer.json; `generate` needs the checkpoint's tokenizer")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise InvalidInput(f"{file}: cannot load tokenizer: {str(e)[:200]}") from None
        cfg_file = path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        jinja = path / "chat_template.jinja"  # where newer checkpoints (gpt-oss's harmony template) keep it
        if not self.config.get("chat_template") and jinja.is_file():
            self.config["chat_template"] = jinja.read_text(encoding="utf-8")

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int], special: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=not special)

    def token_id(self, key: str) -> int | None:
        name = self._special(key)
        return self.tok.token_to_id(name) if name else None

    def chat(self, messages: list[dict], **options) -> str:
        """Renders the chat template with a generation prompt; `options` are the template's own variables
        (gpt-oss's reasoning_effort), passed when given."""
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise InvalidInput("this checkpoint has no chat_template in tokenizer_config.json; drop --chat")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def fail(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = fail
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)  # as transformers offers it (gpt-oss's date)
        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                     bos_token=self._special("bos_token") or "",
                                                     eos_token=self._special("eos_token") or "", **options)
        except TemplateError as e:
            raise InvalidInput(f"chat template failed: {e}") from None


HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


class Channels:
    """gpt-oss's output (OpenAI's harmony format) split into reasoning and content as its tokens arrive.

    A completion is a run of messages `<|start|>assistant<|channel|>NAME<|message|>TEXT<|end|>`, the last
    ending `<|return|>` (or `<|call|>`); the prompt ends inside the first header (`<|start|>assistant`). The
    text of `analysis` messages is the reasoning, that of the others (`final`, `commentary`) the content,
    as vLLM's OpenAI server returns them (`reasoning_content`, `content`); headers and markers are neither.
    A message whose header names a function as its recipient (`to=functions.NAME`, before or after the
    channel) is a tool call: its text is the call's arguments, collected in `calls` as (NAME, text) once it
    ends (`<|call|>`), not content. One instance per sequence; `of(codec)` is None for a tokenizer without
    the harmony tokens."""

    def __init__(self, codec: TextCodec, ids: dict[int, str]):
        self.codec, self.ids = codec, ids
        self.header: list[int] | None = []  # tokens of the header being read; None inside a message's text
        self.channel = ""
        self.body: list[int] = []
        self.window = (0, 0)  # incremental decoding of the body, as the engine's (a word-initial space)
        self.recipient: str | None = None  # the function a tool-call message addresses
        self.calls: list[tuple[str, str]] = []

    @classmethod
    def of(cls, codec: TextCodec) -> "Channels | None":
        ids = {codec.tok.token_to_id(name): name for name in HARMONY}
        return None if None in ids else cls(codec, ids)

    def feed(self, tokens: list[int], done: bool = False) -> tuple[str, str]:
        """(reasoning, content) text that `tokens` complete; done: the sequence ended (text held back for a
        partial character is let out)."""
        out = {True: [], False: []}
        for t in tokens:
            mark = self.ids.get(t)
            if mark == "<|start|>":
                self.header = []
            elif mark == "<|message|>":
                head = self.header or []
                at = next((i for i, x in enumerate(head) if self.ids.get(x) == "<|channel|>"), None)
                words = self.codec.decode(head[at + 1:]).split() if at is not None else []
                to = re.search(r"\bto=functions\.([\w.\-]+)", self.codec.decode(head))
                self.recipient = to.group(1) if to else None
                self.channel, self.header, self.body, self.window = (words or [""])[0], None, [], (0, 0)
            elif mark in ("<|end|>", "<|return|>", "<|call|>"):
                self._end(out)
            elif self.header is not None:
                self.header.append(t)
            else:
                self.body.append(t)
                if self.recipient is None:
                    self._flush(out, False)
        if done:
            self._end(out)
        return "".join(out[True]), "".join(out[False])

    def _end(self, out: dict) -> None:
        """The message being read ends: its held-back text let out, or its call collected."""
        if self.recipient is not None and self.header is None:
            self.calls.append((self.recipient, self.codec.decode(self.body)))
        elif self.header is None:
            self._flush(out, True)
        self.header, self.body, self.recipient = None, [], None

    def _flush(self, out: dict, whole: bool) -> None:
        lo, mid = self.window
        before, now = self.codec.decode(self.body[lo:mid]), self.codec.decode(self.body[lo:])
        if len(now) > len(before) and (whole or not now.endswith("\ufffd")):
            out[self.channel == "analysis"].append(now[len(before):])
            self.window = (mid, len(self.body))
