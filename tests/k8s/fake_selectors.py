"""Label and field selectors, parsed and matched the way the API server does it.

A selector the real server would reject must be rejected here too (HTTP 400), or a typo in the
controller's selector would pass every test and match nothing in production.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_KEY = rf"(?:[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/)?{_NAME}"
_VALUE_RE = re.compile(rf"(?:{_NAME})?")
# One requirement, then a comma or the end. Set operators need a space before `in`/`notin`
# ("keyin (a)" is a key named "keyin"), exactly as the real lexer splits tokens.
_REQUIREMENT_RE = re.compile(
    rf"""\s*(?:
        !\s*(?P<absent>{_KEY})
      | (?P<key>{_KEY})\s*(?:
            (?P<op>==|=|!=|>|<)\s*(?P<value>[^,\s]*)
          | \s(?P<setop>in|notin)\s*\((?P<values>[^)]*)\)
        )?
    )\s*(?:,|$)""",
    re.VERBOSE,
)


class SelectorError(ValueError):
    """The selector does not parse; the server answers 400 BadRequest."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "exists", "!", "=", "!=", "in", "notin", ">", "<"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key, "")
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        # `!=` and `notin` match objects that lack the key altogether: that is the real semantics
        # and the reason `gpu!=true` also selects nodes with no gpu label.
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if not present:
            return False
        try:
            number = int(value)
        except ValueError:
            return False
        bound = int(self.values[0])
        return number > bound if self.op == ">" else number < bound


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        requirements: list[Requirement] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _REQUIREMENT_RE.match(text, pos)
            if m is None or m.end() == pos:
                raise SelectorError(f"unable to parse requirement: {text[pos:]!r}")
            requirements.append(_requirement(m))
            pos = m.end()
        return cls(tuple(requirements))

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)


def _requirement(m: re.Match[str]) -> Requirement:
    if m["absent"]:
        return Requirement(m["absent"], "!")
    key = m["key"]
    if m["op"]:
        op = "=" if m["op"] == "==" else m["op"]
        value = m["value"]
        if op in ("<", ">"):
            if not re.fullmatch(r"-?[0-9]+", value):
                raise SelectorError(
                    f"for 'Gt', 'Lt' operators, the value must be an integer: {value}"
                )
        elif not _VALUE_RE.fullmatch(value) or len(value) > 63:
            raise SelectorError(f"invalid label value: {value!r}")
        return Requirement(key, op, (value,))
    if m["setop"]:
        values = tuple(v.strip() for v in m["values"].split(","))
        if values == ("",):
            raise SelectorError("for 'in', 'notin' operators, values set can't be empty")
        for value in values:
            if not _VALUE_RE.fullmatch(value):
                raise SelectorError(f"invalid label value: {value!r}")
        return Requirement(key, m["setop"], values)
    return Requirement(key, "exists")


@dataclass(frozen=True)
class FieldSelector:
    """Only equality tests on a per-resource list of fields, as the server supports."""

    terms: tuple[tuple[str, bool, str], ...] = ()  # (field, equal?, value)

    @classmethod
    def parse(cls, text: str, supported: Iterable[str]) -> FieldSelector:
        allowed = set(supported)
        terms: list[tuple[str, bool, str]] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(.*)", part)
            if m is None:
                raise SelectorError(f"invalid selector: {part!r}; can't understand {part!r}")
            field, op, value = m.groups()
            if field not in allowed:
                only = ", ".join(f'"{f}"' for f in sorted(allowed))
                raise SelectorError(f'"{field}" is not a known field selector: only {only}')
            terms.append((field, op != "!=", value))
        return cls(tuple(terms))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        return all((field_value(obj, f) == value) == equal for f, equal, value in self.terms)


@dataclass(frozen=True)
class Selector:
    """A request's labelSelector and fieldSelector together."""

    labels: LabelSelector
    fields: FieldSelector

    @classmethod
    def parse(cls, label_selector: str, field_selector: str, fields: Iterable[str]) -> Selector:
        return cls(LabelSelector.parse(label_selector), FieldSelector.parse(field_selector, fields))

    @property
    def empty(self) -> bool:
        return not self.labels.requirements and not self.fields.terms

    def matches(self, obj: Mapping[str, Any]) -> bool:
        return self.labels.matches(obj["metadata"].get("labels")) and self.fields.matches(obj)


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string a field selector compares against: missing fields read as ""."""
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return ""
        node = node.get(part)
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    if isinstance(node, Mapping):  # events' `source` selects on source.component
        return str(node.get("component", ""))
    return str(node)
