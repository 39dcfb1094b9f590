"""Structured output: a shape every row's text must have (a JSON Schema, a choice list, a
regex), enforced token by token in the transformers engine and checked for every engine.

The shape becomes one regular expression (outlines-core turns a JSON Schema into one, as vLLM's
outlines backend does); outlines-core's `Index` maps it onto the tokenizer's vocabulary once
per engine and shape, and each sequence walks it with a `Guide`: at every step only the tokens
that keep the text a prefix of a match may be chosen, the end-of-text token only where the text
is a whole match. A server is sent the shape in the fields vLLM and SGLang read. Whatever the
engine, the stage checks each row's finished text against the shape: a row cut by its
`max_tokens`, or from a server that ignored the request, is an error row, never a wrong value.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from functools import cache
from typing import Any

from ebb.common.job import StructuredSpec

_REGEX_META = set("\\.+*?()|[]{}^$#&-~ ")

INDEXES_KEPT = 256
"""Shapes' indexes an engine keeps, the most recently used (rows' own shapes may be many)."""
INDEX_BUILD_S = 30.0
"""How long a row's own shape may take to be mapped onto the vocabulary. outlines-core's time
is hard to foresee from a schema (a top-level string of `maxLength: 256` took minutes on a
small vocabulary, one of 2,000 inside an object under a second): a request's schema that takes
longer is an error row, and the child process making it is killed."""


def _escape(text: str) -> str:
    """`text` as a regex matching it alone, escaping only what is special (Rust's regex
    dialect, which outlines-core reads, refuses Python's escapes of plain letters)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


@dataclass(frozen=True)
class Structure:
    """One stage's shape: its regex (outlines-core's dialect) and how a text is checked."""

    kind: str
    """`json`, `choice` or `regex`."""
    value: Any
    """The schema, the choices or the regex, as the spec gives it."""
    regex: str

    @classmethod
    def of(cls, spec: StructuredSpec) -> Structure:
        if spec.json is not None:
            from outlines_core.json_schema import build_regex_from_schema

            try:
                regex = build_regex_from_schema(json.dumps(spec.json))
            except (ValueError, TypeError) as e:
                raise ValueError(f"structured.json: not a JSON Schema it can enforce: {e}") from e
            return cls("json", spec.json, regex)
        if spec.choice is not None:
            either = "|".join(map(_escape, spec.choice))
            return cls("choice", tuple(spec.choice), f"({either})")
        assert spec.regex is not None
        return cls("regex", spec.regex, spec.regex)

    def check(self, text: str) -> str | None:
        """Why `text` does not have this shape; None when it does."""
        if self.kind == "choice":
            return None if text in self.value else f"{text!r} is none of {list(self.value)}"
        if self.kind == "json":
            try:
                json.loads(text)
            except ValueError as e:
                return f"not JSON ({e}): {text[:200]!r}"
            pattern = _python(self.regex)
            if pattern is None or pattern.fullmatch(text):
                return None
            return f"JSON, but not of the schema: {text[:200]!r}"
        return None if re.fullmatch(self.value, text) else f"{text[:200]!r} does not match"

    def request_fields(self) -> dict[str, Any]:
        """What a server is sent to enforce it: vLLM's `structured_outputs` and SGLang's
        `regex` (each server ignores the other's). A JSON Schema goes as the regex it became
        here, not as the schema: the server then allows the whitespace this engine allows (a
        space at most between tokens) where its own JSON grammar allows any run of it, which a
        weak model fills until `max_tokens` (seen with vLLM's xgrammar), and every engine's
        rows have one shape."""
        if self.kind == "choice":
            return {"structured_outputs": {"choice": list(self.value)}, "regex": self.regex}
        return {"structured_outputs": {"regex": self.regex}, "regex": self.regex}


@cache
def _python(regex: str) -> re.Pattern[str] | None:
    """The schema's regex in Python's dialect; None where only Rust's reads it (the text is
    then checked as JSON alone)."""
    try:
        return re.compile(regex)
    except re.error:
        return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def vocabulary_bytes(tokenizer: Any, skip: set[int]) -> dict[bytes, list[int]]:
    """Each token's bytes as it adds them to a text (the ids that write them), the ids in
    `skip` (special tokens) left out: what outlines-core's `Vocabulary` is built from."""
    decoder = ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    byte_level = '"ByteLevel"' in decoder
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    out: defaultdict[bytes, list[int]] = defaultdict(list)
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in skip:
            continue
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
        if byte_level and all(c in to_byte for c in token):
            data = bytes(to_byte[c] for c in token)
        elif fallback:
            data = bytes([int(fallback[1], 16)])
        else:
            data = token.replace("▁", " ").encode()  # SentencePiece's word marker
        if data:
            out[data].append(token_id)
    return dict(out)


class Guides:
    """An engine's token guides: the vocabulary once, an index per shape, a guide per row."""

    def __init__(self, tokenizer: Any, eos: set[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = min(eos) if eos else tokenizer.eos_token_id
        self._vocabulary: Any = None
        self._indexes: OrderedDict[str, Any] = OrderedDict()

    def guide(self, structure: Structure, *, time_limit: float | None = None) -> Any:
        """A new walk of `structure`'s index, made the first time (in a child process killed
        past `time_limit` seconds, when given: a request's shape; in this one otherwise)."""
        from outlines_core import Guide, Index, Vocabulary

        if self._vocabulary is None:
            skip = set(self._tokenizer.all_special_ids)
            self._vocabulary = Vocabulary(
                self._eos, vocabulary_bytes(self._tokenizer, skip | {self._eos})
            )
        index = self._indexes.get(structure.regex)
        if index is not None:
            self._indexes.move_to_end(structure.regex)
        else:
            if time_limit is not None:
                index = _index_in_child(structure.regex, self._vocabulary, time_limit)
            else:
                try:
                    index = Index(structure.regex, self._vocabulary)
                except ValueError as e:
                    raise ValueError(
                        f"structured output: the model's tokens cannot write it: {e}"
                    ) from e
            self._indexes[structure.regex] = index
            if len(self._indexes) > INDEXES_KEPT:
                self._indexes.popitem(last=False)
        return Guide(index)

    @property
    def eos(self) -> int:
        return int(self._eos)


def _index_in_child(regex: str, vocabulary: Any, time_limit: float) -> Any:
    """outlines-core's `Index` of `regex` over `vocabulary`, made by a child process (this
    module run as a script) that is killed past `time_limit` seconds: the index's time is not
    bounded by anything a request's schema can be checked for."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__],
            input=pickle.dumps((regex, vocabulary)),
            capture_output=True,
            timeout=time_limit,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"structured output: mapping it onto the model's tokens took over {time_limit:g} s "
            "(bounds such as a string's maxLength make it slow): not enforced"
        ) from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(
            f"structured output: the model's tokens cannot write it: {why[-1] if why else ''}"
        )
    return pickle.loads(done.stdout)  # noqa: S301 (this module's own child wrote it)


def _make_index() -> None:
    """The child's side of `_index_in_child`: (regex, vocabulary) on stdin, the index out."""
    from outlines_core import Index

    regex, vocabulary = pickle.load(sys.stdin.buffer)  # noqa: S301 (its parent's)
    try:
        index = Index(regex, vocabulary)
    except ValueError as e:
        print(str(e).replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    sys.stdout.buffer.write(pickle.dumps(index))


if __name__ == "__main__":
    _make_index()
