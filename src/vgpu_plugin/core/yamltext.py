"""YAML text to plain Python values, refusing what PyYAML would let pass silently."""

from __future__ import annotations

from typing import Any

import yaml


class YamlProblem(ValueError):
    """The text is not one YAML document of plain values; the message says where."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: PyYAML keeps the last one without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Only the map's own keys: a key that overrides one brought in by `<<: *anchor` is fine.
        own: list[object] = []
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in own:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            own.append(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> object:
    """The single document in ``text``; None when it holds nothing but comments."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = ", ".join(part for part in (exc.context, exc.problem) if part) or "invalid YAML"
        raise YamlProblem(f"{where}{what}") from None
    except yaml.YAMLError as exc:
        raise YamlProblem(f"invalid YAML: {exc}") from None
