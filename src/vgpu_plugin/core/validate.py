"""Walk a loaded YAML tree against the schema table, collecting every error with its path.

The result keeps only the keys that were given and valid, with clean values; maps stay dicts and
lists of maps stay lists, so the builder in ``config`` sees exactly what the admin wrote.
"""

from __future__ import annotations

import difflib
from typing import Any

from vgpu_plugin.core.schema import SHOWN_CHARS, Invalid, KeySpec, children, clip, show, spec_for


def check_tree(data: object, errors: list[str]) -> dict[str, Any]:
    """The top-level map of ``data``, cleaned; problems are appended to ``errors``."""
    if not isinstance(data, dict):
        errors.append(f"top level: must be a map of settings (version: v1, ...), got {show(data)}")
        return {}
    return _map(data, "", "", errors)


def _join(shown: str, key: str) -> str:
    return f"{shown}.{key}" if shown else key


def _map(value: dict[Any, Any], spec_path: str, shown: str, errors: list[str]) -> dict[str, Any]:
    spec = spec_for(spec_path) if spec_path else None
    allowed = dict(children(spec_path))
    if spec is not None and spec.same_keys_as:
        allowed = {k: s for k, s in children(spec.same_keys_as).items() if not s.is_container}
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            errors.append(f"{_join(shown, show(key))}: keys must be strings")
            continue
        child = allowed.get(key)
        if child is None:
            named = key if len(key) <= SHOWN_CHARS and key.isprintable() else clip(key)
            hint = len(errors) < _HINTS  # difflib for each of 60,000 bad keys is seconds
            errors.append(f"{_join(shown, named)}: {_unknown(key, allowed, hint)}")
            continue
        clean = _value(item, child, _join(shown, key), errors)
        if clean is not _BAD:
            out[key] = clean
    for key, child in allowed.items():
        if child.required and key not in value:
            errors.append(f"{_join(shown, key)}: required")
    return out


_HINTS = 100


def _unknown(key: str, allowed: dict[str, KeySpec], suggest: bool = True) -> str:
    if not allowed:
        return "unknown key"
    guess = (
        difflib.get_close_matches(key[: SHOWN_CHARS * 2], allowed, n=1, cutoff=0.6)
        if suggest
        else []
    )
    hint = f"did you mean {guess[0]}? " if guess else ""
    return f"unknown key ({hint}known keys: {', '.join(allowed)})"


_BAD = object()


def _value(item: object, spec: KeySpec, shown: str, errors: list[str]) -> object:
    if spec.check is not None:
        try:
            return spec.check(item)
        except Invalid as exc:
            errors.append(f"{shown}{exc.where}: {exc.message}")
            return _BAD
    if spec.type == "map":
        if item is None:  # `health:` with nothing under it
            item = {}
        if not isinstance(item, dict):
            errors.append(f"{shown}: must be a map, got {show(item)}")
            return _BAD
        return _map(item, spec.path, shown, errors)
    if item is None:
        item = []
    if not isinstance(item, list):
        errors.append(f"{shown}: must be a list, got {show(item)}")
        return _BAD
    items: list[dict[str, Any]] = []
    for i, element in enumerate(item):
        where = f"{shown}[{i}]"
        if not isinstance(element, dict):
            errors.append(f"{where}: must be a map, got {show(element)}")
            items.append({})
            continue
        items.append(_map(element, f"{spec.path}[]", where, errors))
    return items
