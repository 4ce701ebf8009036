"""YAML text to plain Python values, refusing what PyYAML would let pass silently."""

from __future__ import annotations

from typing import Any

import yaml

from vgpu_plugin.core.schema import clip


class YamlProblem(ValueError):
    """The text is not one YAML document of plain values; the message says where."""


# libyaml's parser where PyYAML was built with it (ten times faster on big files); the
# construction below is the same Python either way.
_SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_SafeLoader):  # type: ignore[valid-type,misc]
    """SafeLoader that rejects duplicate keys: PyYAML keeps the last one without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Only the map's own keys: a key that overrides one brought in by `<<: *anchor` is fine.
        # A set, so 60,000 keys cost 60,000 lookups, not 60,000² comparisons; keys that
        # cannot be hashed (a list as a key) are compared the slow way, and are rare.
        own: set[object] = set()
        unhashable: list[object] = []
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = key in own
                own.add(key)
            except TypeError:
                seen = key in unhashable
                unhashable.append(key)
            if seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {clip(key)}", key_node.start_mark
                )
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # Python refuses to convert integers of over 4,300 digits (a ValueError PyYAML does not
        # catch); no setting needs more than a few digits.
        text = str(self.construct_scalar(node))
        if len(text) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"integer of {len(text)} characters (at most {MAX_INT_CHARS})",
                node.start_mark,
            )
        value: int = super().construct_yaml_int(node)
        return value


MAX_INT_CHARS = 40
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)

# Nodes that aliases may add to the document once expanded (the text's own nodes are not
# counted). A config uses an anchor for a few shared settings; a 330-byte "billion laughs"
# expands to hundreds of millions of nodes, and would cost minutes and gigabytes to build,
# compare as duplicate keys and print.
MAX_ALIAS_NODES = 10_000


def _where(node: yaml.Node) -> str:
    mark = node.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_expansion(root: yaml.Node, budget: int = MAX_ALIAS_NODES) -> None:
    """Refuses, before anything is built, a node graph whose aliases expand it by more than
    ``budget`` nodes, a recursive alias, and a mapping key that is not a scalar (no setting
    has one; a duplicated complex key was how a 330-byte text froze the plugin). Counts the
    expanded size of each distinct node once: linear in the text, however much it expands."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finish = stack.pop()
        key = id(node)
        if finish:
            open_.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] - len(sizes) > budget:
                raise YamlProblem(
                    f"{_where(node)}aliases expand this document by more than {budget} nodes"
                    " (an alias bomb?)"
                )
            continue
        if key in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            for k, _ in node.value:
                if not isinstance(k, yaml.ScalarNode):
                    kind = "a list" if isinstance(k, yaml.SequenceNode) else "a map"
                    raise YamlProblem(f"{_where(k)}a key must be a plain value, not {kind}")
        open_.add(key)
        stack.append((node, True))
        for c in _children(node):
            if id(c) in open_:
                raise YamlProblem(f"{_where(c)}an alias refers to a node that contains it")
            if id(c) not in sizes:
                stack.append((c, False))


def _load(text: str) -> object:
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml(text: str) -> object:
    """The single document in ``text``; None when it holds nothing but comments."""
    try:
        return _load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = ", ".join(part for part in (exc.context, exc.problem) if part) or "invalid YAML"
        raise YamlProblem(f"{where}{what}") from None
    except yaml.YAMLError as exc:
        raise YamlProblem(f"invalid YAML: {exc}") from None
