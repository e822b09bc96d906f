"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice, Lark grammar,
structural tag) compiled by llguidance into a token matcher that says, before each sample, which tokens of
the vocabulary may come next, as a packed bitmask the step applies on device (step.pick).

Why llguidance: no Python dependencies (one Rust wheel), masks computed lazily over a token trie in tens of
microseconds a row even for 200k-token vocabularies (docs/benchmarks.md), JSON schema, regex and Lark
grammars behind one matcher type, and it is what vLLM's `guidance` backend runs. xgrammar needs torch at
run time, which quantkit's serving install does not carry.

Bit order (llguidance's): token t is allowed when bit t % 32 of word t // 32 is set; words are int32, the
vocabulary padded to whole words with cleared bits.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from quantkit.errors import InvalidInput

KINDS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")
# JSON written compactly by default: a grammar allowing any whitespace between tokens lets a model emit
# blanks until max_tokens. Python's json.dumps separators, no other whitespace; a request may ask for the
# library's flexible whitespace (vLLM's disable_any_whitespace: false) or its own whitespace_pattern.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def words(vocab: int) -> int:
    """int32 words of a vocabulary's bitmask (llguidance's layout)."""
    return -(-vocab // 32)


def device_words(vocab: int) -> int:
    """int32 words of a row's mask in the device layout (`spread`): words(vocab) rounded up to 1,024."""
    return -(-vocab // (32 * 1024)) * 1024


def spread(mask: np.ndarray, width: int) -> np.ndarray:
    """A bitmask in llguidance's layout (token t: bit t % 32 of word t // 32) in the device's, `width`
    (device_words) words, which the sampler reads (step.allowed_logits, kernels/sample.py): token t is bit
    t // width of word t % width, so that any aligned run of tokens is one bit of one aligned run of words."""
    raw = np.zeros(width, np.int32)
    raw[:mask.size] = mask
    bits = np.unpackbits(raw.view(np.uint8), bitorder="little").reshape(32, width)  # [bit plane, word]
    return np.packbits(bits.T.copy(), bitorder="little").view(np.int32)  # 0.07 ms at 128k tokens (this CPU)


class Grammar:
    """One sequence's matcher: the mask of its next token, advanced by each token it accepts."""

    def __init__(self, matcher, n_words: int):
        self.m, self.mask = matcher, np.zeros(n_words, np.int32)

    def fill(self) -> bool:
        """Computes the next token's mask into `self.mask`; False when no token is allowed (the constraint
        cannot continue: a dead end, or the matcher in error)."""
        if self.m.is_error() or self.m.is_stopped():
            return False
        self.m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        return not self.m.is_error() and bool(self.mask.any())

    def accept(self, token: int) -> bool:
        """Advances past a sampled token; False when the matcher refuses it (then it is in error)."""
        return self.m.consume_token(token)


class Constraints:
    """Per checkpoint: its tokenizer as llguidance sees it, and compiled constraints (a matcher per distinct
    grammar, kept as a template each request's matcher is copied from)."""

    CACHED = 64

    def __init__(self, tokenizer_json: Path, vocab: int, eos_ids):
        import llguidance

        self.ll = llguidance
        self.n_words = words(vocab)
        eos = sorted(eos_ids)
        self.tok = llguidance.LLTokenizer(tokenizer_json.read_text(encoding="utf-8"), n_vocab=vocab,
                                          eos_token=eos or None)
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, kind: str, spec, whitespace: dict | None = None) -> str:
        """llguidance's grammar text for a constraint; InvalidInput saying what is wrong with it.

        kind: json (a JSON schema, object or JSON text), json_object (any JSON object), regex, choice (a list of
        strings), grammar (Lark, or GBNF, which is converted), structural_tag (vLLM's JSON form).
        whitespace: llguidance JSON options (default COMPACT)."""
        ll, options = self.ll, whitespace or COMPACT
        try:
            if kind == "json":
                schema = json.loads(spec) if isinstance(spec, str) else spec
                if not isinstance(schema, (dict, bool)):
                    raise InvalidInput("a JSON schema must be an object")
                return ll.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if kind == "json_object":
                return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
            if kind == "regex":
                if not isinstance(spec, str):
                    raise InvalidInput("a regex must be a string")
                return ll.LLMatcher.grammar_from_regex(spec)
            if kind == "choice":
                if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
                    raise InvalidInput("choice must be a non-empty list of strings")
                return ll.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(spec)))
            if kind == "grammar":
                if not isinstance(spec, str) or not spec.strip():
                    raise InvalidInput("a grammar must be a non-empty string (Lark, or GBNF)")
                from llguidance.gbnf_to_lark import any_to_lark

                return ll.LLMatcher.grammar_from_lark(any_to_lark(spec))
            if kind == "structural_tag":
                return _structural_tag(ll, json.loads(spec) if isinstance(spec, str) else spec, options)
        except InvalidInput:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidInput(str(e).splitlines()[0][:300]) from None
        raise InvalidInput(f"unknown constraint kind {kind!r}")

    def matcher(self, grammar: str) -> Grammar:
        """A fresh matcher for one sequence, the grammar compiled once (cached); InvalidInput with the
        library's reason when it does not compile."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
        if template is None:
            template = self.ll.LLMatcher(self.tok, grammar, log_level=0)
            if template.is_error():
                raise InvalidInput(template.get_error().splitlines()[0][:300])
            with self._lock:
                self._templates[grammar] = template
                while len(self._templates) > self.CACHED:
                    self._templates.popitem(last=False)
        return Grammar(template.deep_copy(), self.n_words)


def _structural_tag(ll, spec, options: dict) -> str:
    """vLLM's structural tag: {"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}: free text, where each trigger starts one of the structures, whose body is JSON valid
    against its schema, closed by its end."""
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not isinstance(
            spec.get("triggers"), list):
        raise InvalidInput("a structural_tag needs 'structures' (begin, schema, end) and 'triggers'")
    tags = []
    for s in spec["structures"]:
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise InvalidInput("each structure needs 'begin' and 'end' strings and a 'schema'")
        trigger = next((t for t in spec["triggers"] if isinstance(t, str) and s["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidInput(f"no trigger starts the structure beginning {s['begin']!r}")
        schema = s.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidInput("a structure's 'schema' must be a JSON schema object")
        tags.append(ll.StructTag(trigger=trigger, begin=s["begin"], grammar={**schema, "x-guidance": options},
                                 end=s["end"]))
    return ll.StructTag.to_grammar(tags, assume_special=False)
