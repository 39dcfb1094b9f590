"""PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

Strategic merge patch is applied as a JSON merge patch. The two differ only for lists that
carry a patch strategy (containers merged by name, conditions by type, finalizers unioned):
a strategic patch of such a list here replaces it, where the real server would merge.
"""

from __future__ import annotations

import copy
from typing import Any


class PatchError(ValueError):
    """The patch applies but fails (a failed `test`, a missing path): HTTP 422."""


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(doc: Any, operations: list[Any]) -> Any:
    doc = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid operation {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            doc, _ = _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            value = _get(doc, op.get("from", ""))
            if kind == "move":
                doc, value = _remove(doc, op["from"])
            doc = _add(doc, path, copy.deepcopy(value))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"testing value {path} failed")
        else:
            raise PatchError(f"unexpected kind of operation: {kind!r}")
    return doc


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    tokens = _tokens(path)
    if not tokens:
        raise PatchError("the whole document cannot be patched")
    node = doc
    for token in tokens[:-1]:
        node = _child(node, token, path)
    return node, tokens[-1]


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict) and token in node:
        return node[token]
    if isinstance(node, list) and token.isdigit() and int(token) < len(node):
        return node[int(token)]
    raise PatchError(f"path {path!r} does not exist")


def _get(doc: Any, path: str) -> Any:
    node = doc
    for token in _tokens(path):
        node = _child(node, token, path)
    return node


def _add(doc: Any, path: str, value: Any) -> Any:
    parent, last = _parent(doc, path)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise PatchError(f"index out of range in {path!r}")
    else:
        raise PatchError(f"path {path!r} does not exist")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    parent, last = _parent(doc, path)
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return doc, parent.pop(int(last))
    raise PatchError(f"path {path!r} does not exist")
