"""Text <-> tokens with the `tokenizers` library, and chat templates from tokenizer_config.json (jinja2,
sandboxed: a checkpoint's template is untrusted input)."""

from __future__ import annotations

import json
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

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, key: str) -> int | None:
        name = self._special(key)
        return self.tok.token_to_id(name) if name else None

    def chat(self, messages: list[dict]) -> str:
        """Renders the chat template with a generation prompt."""
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
        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                     bos_token=self._special("bos_token") or "",
                                                     eos_token=self._special("eos_token") or "")
        except TemplateError as e:
            raise InvalidInput(f"chat template failed: {e}") from None
