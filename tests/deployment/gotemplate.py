"""A renderer for the subset of Go templates and Helm/sprig functions the chart uses.

No Helm binary can be had from PyPI or Debian, so the tests render ``deploy/helm/vgpu-plugin``
with this instead. It follows Go's ``text/template`` and Helm's conventions where the chart
relies on them, and refuses anything else loudly (an unknown function, keyword or construct is
a ``TemplateError``), so a chart change that needs more than this subset fails the tests
rather than rendering wrongly:

- actions ``{{ }}`` with the trim markers ``{{-``/``-}}`` and comments ``{{/* */}}``;
- ``if``/``else if``/``else``, ``with``/``else``, ``range`` (lists and maps, in Go's sorted key
  order, with ``$v :=`` or ``$k, $v :=``), ``define``, ``template``, ``end``;
- pipelines with ``|``, parenthesised sub-pipelines, ``.Field`` chains, ``$``, ``$var.Field``,
  ``$x := ...`` and ``$x = ...``; literals: strings, raw strings, numbers, true/false/nil;
- functions: see ``FUNCTIONS`` (and ``include``, ``fail``, ``required``).

Where Helm differs from plain Go it is followed: a missing map key is nil (printed as nothing,
as Helm strips ``<no value>``), a field of nil is an error, numbers print as Go prints the
float64 that Helm's values hold (``1000000`` prints ``1e+06``), ``and``/``or`` short-circuit,
``toYaml`` drops the final newline. ``eq``/``ne`` refuse numbers: values numbers are float64 in
Helm and template literals are int, and Go's ``eq`` errors on that mix.

What is not modelled: the exact text of ``toYaml`` (the tests compare parsed objects, not
bytes), ``tpl``, ``lookup``, ``.Files``, ``.Capabilities`` beyond what ``chart.py`` passes in.
"""

from __future__ import annotations

import decimal
import json
import math
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

NO_VALUE = "<no value>"


class TemplateError(Exception):
    """The template is outside the supported subset, or fails as Go/Helm would fail it."""


class ChartFail(TemplateError):
    """``fail`` or ``required`` stopped the rendering; the message is the chart's."""


# --- lexing -----------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.S)
_SPACE = " \t\r\n"


@dataclass
class _Piece:
    kind: str  # "text" | "action"
    text: str
    line: int


def _lex(source: str) -> list[_Piece]:
    pieces: list[_Piece] = []
    pos = 0
    trim_next = False
    for m in _ACTION.finditer(source):
        text = source[pos : m.start()]
        if trim_next:
            text = text.lstrip(_SPACE)
        if m.group(1):
            text = text.rstrip(_SPACE)
        line = source.count("\n", 0, m.start()) + 1
        if text:
            pieces.append(_Piece("text", text, line))
        body = m.group(2).strip(_SPACE)
        if not (body.startswith("/*") and body.endswith("*/")):
            pieces.append(_Piece("action", body, line))
        elif "*/" in body[2:-2]:
            raise TemplateError(f"line {line}: text after a comment in one action")
        trim_next = bool(m.group(3))
        pos = m.end()
    text = source[pos:]
    if trim_next:
        text = text.lstrip(_SPACE)
    if "{{" in text:
        raise TemplateError(f"unclosed action: {text[:40]!r}")
    if text:
        pieces.append(_Piece("text", text, source.count("\n") + 1))
    return pieces


_TOKEN = re.compile(
    r"""
    (?P<str>"(?:\\.|[^"\\])*")
  | (?P<raw>`[^`]*`)
  | (?P<num>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<decl>:=)
  | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[()|,=])
    """,
    re.X,
)


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str


def _tokens(body: str, line: int) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    out_end = -1
    while pos < len(body):
        if body[pos] in _SPACE:
            pos += 1
            continue
        m = _TOKEN.match(body, pos)
        if m is None or m.lastgroup is None:
            raise TemplateError(f"line {line}: cannot read {body[pos : pos + 20]!r}")
        if m.lastgroup == "field" and out and out[-1].text == ")" and pos == out_end:
            raise TemplateError(f"line {line}: fields of a parenthesised value are not supported")
        out.append(_Tok(m.lastgroup, m.group()))
        pos = out_end = m.end()
    return out


# --- the tree ---------------------------------------------------------------------------------

# ("lit", v) ("dot", fields) ("var", name, fields) ("fn", name) ("sub", pipe)
Expr = tuple[Any, ...]


@dataclass
class _Pipe:
    decl: tuple[str, ...]
    assign: bool  # "=" (assign to an existing variable) rather than ":="
    cmds: list[list[Expr]]
    line: int


@dataclass
class _Node:
    kind: str  # text, output, if, with, range, template
    text: str = ""
    pipe: _Pipe | None = None
    body: list[_Node] = field(default_factory=list)
    # if: (condition, body) pairs after the first; with/range/if: the else body
    elifs: list[tuple[_Pipe, list[_Node]]] = field(default_factory=list)
    orelse: list[_Node] = field(default_factory=list)
    name: str = ""


_KEYWORDS = {"if", "else", "end", "range", "with", "define", "template", "block", "break"}


class _Parser:
    def __init__(self, pieces: list[_Piece], defines: dict[str, list[_Node]]) -> None:
        self.pieces = pieces
        self.i = 0
        self.defines = defines

    def parse(self) -> list[_Node]:
        nodes, stop = self._list(top=True)
        if stop is not None:
            raise TemplateError(f"line {stop.line}: unexpected {{{{ {stop.text} }}}}")
        return nodes

    def _list(self, top: bool = False) -> tuple[list[_Node], _Piece | None]:
        """Nodes up to an ``end``/``else`` (returned as the stop piece) or the end of input."""
        nodes: list[_Node] = []
        while self.i < len(self.pieces):
            p = self.pieces[self.i]
            self.i += 1
            if p.kind == "text":
                nodes.append(_Node("text", text=p.text))
                continue
            word = p.text.split(None, 1)[0] if p.text else ""
            rest = p.text[len(word) :].strip(_SPACE)
            if word in ("end", "else"):
                return nodes, p
            if word == "if":
                nodes.append(self._if(rest, p.line))
            elif word in ("with", "range"):
                node = _Node(word, pipe=self._pipe(rest, p.line, allow_decl=True))
                node.body, stop = self._list()
                if stop is not None and stop.text.split()[0] == "else":
                    if stop.text.strip() != "else":
                        raise TemplateError(f"line {stop.line}: only a plain else after {word}")
                    node.orelse, stop = self._list()
                self._expect_end(stop, word, p.line)
                nodes.append(node)
            elif word == "define":
                if not top:
                    raise TemplateError(f"line {p.line}: define inside a block")
                name = self._name(rest, p.line)
                body, stop = self._list()
                self._expect_end(stop, "define", p.line)
                self.defines[name] = body
            elif word == "template":
                name_text, _, arg = rest.partition(" ")
                name = self._name(name_text, p.line)
                pipe = self._pipe(arg, p.line) if arg.strip() else None
                nodes.append(_Node("template", name=name, pipe=pipe))
            elif word in _KEYWORDS:
                raise TemplateError(f"line {p.line}: {word} is not supported")
            else:
                nodes.append(_Node("output", pipe=self._pipe(p.text, p.line, allow_decl=True)))
        return nodes, None

    def _if(self, cond: str, line: int) -> _Node:
        node = _Node("if", pipe=self._pipe(cond, line))
        node.body, stop = self._list()
        while stop is not None and stop.text.split()[0] == "else":
            rest = stop.text[4:].strip(_SPACE)
            if not rest:
                node.orelse, stop = self._list()
                break
            if not rest.startswith("if "):
                raise TemplateError(f"line {stop.line}: unsupported {{{{ {stop.text} }}}}")
            pipe = self._pipe(rest[3:], stop.line)
            body, stop = self._list()
            node.elifs.append((pipe, body))
        self._expect_end(stop, "if", line)
        return node

    @staticmethod
    def _expect_end(stop: _Piece | None, what: str, line: int) -> None:
        if stop is None or stop.text != "end":
            raise TemplateError(f"line {line}: {what} without its end")

    @staticmethod
    def _name(text: str, line: int) -> str:
        text = text.strip(_SPACE)
        if not (len(text) >= 2 and text[0] == text[-1] == '"'):
            raise TemplateError(f"line {line}: expected a quoted template name, got {text!r}")
        return str(json.loads(text))

    def _pipe(self, text: str, line: int, allow_decl: bool = False) -> _Pipe:
        toks = _tokens(text, line)
        if not toks:
            raise TemplateError(f"line {line}: empty pipeline")
        decl: list[str] = []
        assign = False
        if toks[0].kind == "var" and "." not in toks[0].text:
            # $x := ..., $x = ..., $k, $v := ...
            j = 0
            names = [toks[0].text]
            if len(toks) > 2 and toks[1].text == "," and toks[2].kind == "var":
                names.append(toks[2].text)
                j = 2
            if (
                len(toks) > j + 1
                and toks[j + 1].kind in ("decl", "punct")
                and toks[j + 1].text in (":=", "=")
            ):
                if not allow_decl:
                    raise TemplateError(f"line {line}: a declaration is not allowed here")
                decl, assign = names, toks[j + 1].text == "="
                toks = toks[j + 2 :]
        pipe, pos = _parse_cmds(toks, 0, line)
        if pos != len(toks):
            raise TemplateError(f"line {line}: unexpected {toks[pos].text!r}")
        return _Pipe(tuple(decl), assign, pipe, line)


def _parse_cmds(toks: list[_Tok], pos: int, line: int) -> tuple[list[list[Expr]], int]:
    cmds: list[list[Expr]] = []
    cmd: list[Expr] = []
    while pos < len(toks):
        t = toks[pos]
        if t.text == ")":
            break
        pos += 1
        if t.text == "|":
            if not cmd:
                raise TemplateError(f"line {line}: empty command before |")
            cmds.append(cmd)
            cmd = []
        elif t.text == "(":
            sub, pos = _parse_cmds(toks, pos, line)
            if pos >= len(toks) or toks[pos].text != ")":
                raise TemplateError(f"line {line}: unclosed (")
            pos += 1
            cmd.append(("sub", _Pipe((), False, sub, line)))
        elif t.kind == "str":
            cmd.append(("lit", json.loads(t.text)))
        elif t.kind == "raw":
            cmd.append(("lit", t.text[1:-1]))
        elif t.kind == "num":
            is_int = re.fullmatch(r"-?\d+", t.text)
            cmd.append(("lit", int(t.text) if is_int else float(t.text)))
        elif t.kind == "field":
            cmd.append(("dot", tuple(f for f in t.text.split(".") if f)))
        elif t.kind == "var":
            name, *fields = t.text.split(".")
            cmd.append(("var", name, tuple(fields)))
        elif t.kind == "ident":
            if t.text in ("true", "false"):
                cmd.append(("lit", t.text == "true"))
            elif t.text == "nil":
                cmd.append(("lit", None))
            else:
                cmd.append(("fn", t.text))
        else:
            raise TemplateError(f"line {line}: unexpected {t.text!r}")
    if not cmd:
        raise TemplateError(f"line {line}: empty command")
    cmds.append(cmd)
    return cmds, pos


# --- values as Go and Helm see them ----------------------------------------------------------


def truth(value: object) -> bool:
    """Go's truth for if/with/and/or/not: false, 0, nil and empty things are false."""
    if value is None:
        return False
    if isinstance(value, (bool, int, float, str, list, tuple, dict)):
        return bool(value)
    return True


def go_float(x: float) -> str:
    """``fmt.Sprint`` of a float64 (Helm's values numbers): shortest digits, %e from 1e+06."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "-0" if math.copysign(1.0, x) < 0 else "0"
    sign, digits, exponent = decimal.Decimal(repr(x)).normalize().as_tuple()
    assert isinstance(exponent, int)
    ds = "".join(map(str, digits))
    nd = len(ds)
    dp = exponent + nd  # position of the decimal point from the left of the digits
    exp = dp - 1
    neg = "-" if sign else ""
    if exp < -4 or exp >= 6:
        mant = ds[0] + ("." + ds[1:] if nd > 1 else "")
        return f"{neg}{mant}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"
    if dp <= 0:
        return f"{neg}0.{'0' * -dp}{ds}"
    if dp >= nd:
        return f"{neg}{ds}{'0' * (dp - nd)}"
    return f"{neg}{ds[:dp]}.{ds[dp:]}"


def go_string(value: object) -> str:
    """How ``{{ value }}`` prints it."""
    if value is None:
        return NO_VALUE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return go_float(float(value))
    if isinstance(value, str):
        return value
    raise TemplateError(f"printing a {type(value).__name__} directly; use toYaml")


def _yaml_ready(value: object) -> object:
    """Numbers as Helm's toYaml writes them (float64 through JSON: integral ones as ints)."""
    if isinstance(value, dict):
        return {str(k): _yaml_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_ready(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return int(value)
    return value


def to_yaml(value: object) -> str:
    text = yaml.safe_dump(
        _yaml_ready(value), default_flow_style=False, sort_keys=True, allow_unicode=True, width=1000
    )
    if text.endswith("\n...\n"):  # a plain scalar document
        text = text[: -len("...\n")]
    return text.removesuffix("\n")


def _indent(n: int, text: str) -> str:
    pad = " " * n
    return pad + text.replace("\n", "\n" + pad)


def _quote(*values: object) -> str:
    return " ".join(json.dumps(_strval(v), ensure_ascii=False) for v in values if v is not None)


def _strval(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return go_string(value)


def _empty(value: object) -> bool:
    return not truth(value)


def _default(default: object, *given: object) -> object:
    if not given or _empty(given[0]):
        return default
    return given[0]


def _comparable(a: object, b: object) -> None:
    for v in (a, b):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            raise TemplateError(
                "eq/ne on numbers: Helm's values numbers are float64 and literals int, which "
                "Go refuses to compare; compare strings (toString) instead"
            )
    if a is not None and b is not None and type(a) is not type(b):
        raise TemplateError(f"incompatible types for comparison: {a!r} and {b!r}")


def _eq(a: object, *others: object) -> bool:
    for b in others:
        _comparable(a, b)
    return any(a == b for b in others)


def _ne(a: object, b: object) -> bool:
    _comparable(a, b)
    return a != b


def _printf(fmt: str, *args: object) -> str:
    out: list[str] = []
    it = iter(args)
    i = 0
    while i < len(fmt):
        c = fmt[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        verb = fmt[i + 1 : i + 2]
        i += 2
        if verb == "%":
            out.append("%")
            continue
        try:
            arg = next(it)
        except StopIteration:
            raise TemplateError(f"printf {fmt!r}: missing argument") from None
        if verb in ("s", "v"):
            out.append(_strval(arg) if arg is not None else NO_VALUE)
        elif verb == "d":
            if not isinstance(arg, int) or isinstance(arg, bool):
                raise TemplateError(f"printf %d of {arg!r}")
            out.append(str(arg))
        elif verb == "q":
            out.append(json.dumps(_strval(arg), ensure_ascii=False))
        else:
            raise TemplateError(f"printf verb %{verb} is not supported")
    return "".join(out)


def _dig(*args: object) -> object:
    if len(args) < 3:
        raise TemplateError("dig needs keys, a default and a map")
    *keys, default, data = args
    current: object = data
    for key in keys:
        if not isinstance(current, dict) or key not in current:
            return default
        current = current[key]
    return current


def _has_key(data: object, key: object) -> bool:
    if not isinstance(data, dict):
        raise TemplateError(f"hasKey of a {type(data).__name__}")
    return key in data


def _trunc(n: int, text: object) -> str:
    s = _strval(text)
    return s[:n] if n >= 0 else s[n:]


def _to_int(value: object) -> int:
    if isinstance(value, bool) or value is None:
        return int(bool(value))
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        try:
            return int(float(value))
        except ValueError:
            return 0
    raise TemplateError(f"int of a {type(value).__name__}")


def _go_dir(path: str) -> str:
    d = posixpath.dirname(path.rstrip("/") if path != "/" else path) if path else ""
    return posixpath.normpath(d) if d else "."


def _go_base(path: str) -> str:
    if not path:
        return "."
    stripped = path.rstrip("/")
    return posixpath.basename(stripped) if stripped else "/"


def _fail(message: str) -> str:
    raise ChartFail(message)


def _required(message: str, value: object) -> object:
    if value is None or value == "":
        raise ChartFail(message)
    return value


FUNCTIONS: Mapping[str, Callable[..., object]] = {
    "default": _default,
    "empty": _empty,
    "not": lambda v: not truth(v),
    "eq": _eq,
    "ne": _ne,
    "toYaml": to_yaml,
    "nindent": lambda n, s: "\n" + _indent(n, _strval(s)),
    "indent": lambda n, s: _indent(n, _strval(s)),
    "quote": _quote,
    "printf": _printf,
    "toString": _strval,
    "int": _to_int,
    "trunc": _trunc,
    "trimSuffix": lambda suffix, s: _strval(s).removesuffix(suffix),
    "replace": lambda old, new, s: _strval(s).replace(old, new),
    "contains": lambda sub, s: sub in _strval(s),
    "hasKey": _has_key,
    "dig": _dig,
    "list": lambda *items: list(items),
    "dir": _go_dir,
    "base": _go_base,
    "fail": _fail,
    "required": _required,
}


# --- evaluation -------------------------------------------------------------------------------

_NOTHING = object()


class _Scope:
    def __init__(self, root: object) -> None:
        self.frames: list[dict[str, object]] = [{"$": root}]

    def push(self) -> None:
        self.frames.append({})

    def pop(self) -> None:
        self.frames.pop()

    def declare(self, name: str, value: object) -> None:
        self.frames[-1][name] = value

    def assign(self, name: str, value: object, line: int) -> None:
        for frame in reversed(self.frames):
            if name in frame:
                frame[name] = value
                return
        raise TemplateError(f"line {line}: assignment to undeclared {name}")

    def get(self, name: str, line: int) -> object:
        for frame in reversed(self.frames):
            if name in frame:
                return frame[name]
        raise TemplateError(f"line {line}: undefined variable {name}")


class Template:
    """A set of template files sharing their ``define``s, as Helm parses a chart's."""

    def __init__(self) -> None:
        self.defines: dict[str, list[_Node]] = {}
        self.files: dict[str, list[_Node]] = {}

    def add(self, name: str, source: str) -> None:
        try:
            self.files[name] = _Parser(_lex(source), self.defines).parse()
        except TemplateError as exc:
            raise TemplateError(f"{name}: {exc}") from None

    def render(self, name: str, data: object) -> str:
        try:
            text = self._render(self.files[name], data, _Scope(data), 0)
        except ChartFail as exc:
            raise ChartFail(f"{name}: {exc}") from None
        except TemplateError as exc:
            raise TemplateError(f"{name}: {exc}") from None
        return text.replace(NO_VALUE, "")

    # --- internals ---

    def _render(self, nodes: Sequence[_Node], dot: object, scope: _Scope, depth: int) -> str:
        out: list[str] = []
        for node in nodes:
            out.append(self._node(node, dot, scope, depth))
        return "".join(out)

    def _node(self, node: _Node, dot: object, scope: _Scope, depth: int) -> str:
        if node.kind == "text":
            return node.text
        if node.kind == "output":
            assert node.pipe is not None
            value = self._pipe(node.pipe, dot, scope, depth)
            return "" if node.pipe.decl else go_string(value)
        if node.kind == "if":
            assert node.pipe is not None
            branches = [(node.pipe, node.body), *node.elifs]
            for cond, body in branches:
                if truth(self._pipe(cond, dot, scope, depth)):
                    return self._block(body, dot, scope, depth)
            return self._block(node.orelse, dot, scope, depth)
        if node.kind == "with":
            assert node.pipe is not None
            scope.push()
            try:
                value = self._pipe(node.pipe, dot, scope, depth)
                if truth(value):
                    return self._render(node.body, value, scope, depth)
            finally:
                scope.pop()
            return self._block(node.orelse, dot, scope, depth)
        if node.kind == "range":
            return self._range(node, dot, scope, depth)
        if node.kind == "template":
            arg = self._pipe(node.pipe, dot, scope, depth) if node.pipe else None
            return self._include(node.name, arg, depth)
        raise TemplateError(f"unknown node {node.kind}")

    def _block(self, nodes: Sequence[_Node], dot: object, scope: _Scope, depth: int) -> str:
        scope.push()
        try:
            return self._render(nodes, dot, scope, depth)
        finally:
            scope.pop()

    def _range(self, node: _Node, dot: object, scope: _Scope, depth: int) -> str:
        assert node.pipe is not None
        pipe = node.pipe
        bare = _Pipe((), False, pipe.cmds, pipe.line)
        value = self._pipe(bare, dot, scope, depth)
        items: list[tuple[object, object]]
        if value is None:
            items = []
        elif isinstance(value, dict):
            items = [(k, value[k]) for k in sorted(value)]
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        else:
            raise TemplateError(f"line {pipe.line}: range over a {type(value).__name__}")
        if not items:
            return self._block(node.orelse, dot, scope, depth)
        out: list[str] = []
        for key, item in items:
            scope.push()
            try:
                if len(pipe.decl) == 1:
                    scope.declare(pipe.decl[0], item)
                elif len(pipe.decl) == 2:
                    scope.declare(pipe.decl[0], key)
                    scope.declare(pipe.decl[1], item)
                out.append(self._render(node.body, item, scope, depth))
            finally:
                scope.pop()
        return "".join(out)

    def _include(self, name: str, data: object, depth: int) -> str:
        if name not in self.defines:
            raise TemplateError(f"no template {name!r} is defined")
        if depth > 50:
            raise TemplateError(f"include {name!r}: recursion too deep")
        return self._render(self.defines[name], data, _Scope(data), depth + 1)

    def _pipe(self, pipe: _Pipe, dot: object, scope: _Scope, depth: int) -> object:
        value: object = _NOTHING
        for cmd in pipe.cmds:
            value = self._command(cmd, value, dot, scope, depth, pipe.line)
        if pipe.decl:
            if len(pipe.decl) != 1:
                raise TemplateError(f"line {pipe.line}: two variables outside range")
            if pipe.assign:
                scope.assign(pipe.decl[0], value, pipe.line)
            else:
                scope.declare(pipe.decl[0], value)
        return value

    def _command(
        self,
        cmd: list[Expr],
        piped: object,
        dot: object,
        scope: _Scope,
        depth: int,
        line: int,
    ) -> object:
        head = cmd[0]
        if head[0] != "fn":
            if len(cmd) > 1 or piped is not _NOTHING:
                raise TemplateError(f"line {line}: {head!r} is not a function")
            return self._operand(head, dot, scope, depth, line)
        name = head[1]
        args = cmd[1:]

        def evaluate(e: Expr) -> object:
            return self._operand(e, dot, scope, depth, line)

        if name in ("and", "or"):
            thunks: list[Callable[[], object]] = [_thunk(evaluate, e) for e in args]
            if piped is not _NOTHING:
                thunks.append(lambda: piped)
            if not thunks:
                raise TemplateError(f"line {line}: {name} needs arguments")
            result: object = None
            for thunk in thunks:
                result = thunk()
                if truth(result) != (name == "and"):
                    return result
            return result
        values = [evaluate(e) for e in args]
        if piped is not _NOTHING:
            values.append(piped)
        if name == "include":
            if len(values) != 2 or not isinstance(values[0], str):
                raise TemplateError(f"line {line}: include needs a name and a value")
            return self._include(values[0], values[1], depth)
        fn = FUNCTIONS.get(name)
        if fn is None:
            raise TemplateError(f"line {line}: function {name!r} is not supported")
        try:
            return fn(*values)
        except TypeError as exc:
            raise TemplateError(f"line {line}: {name}: {exc}") from None

    def _operand(self, e: Expr, dot: object, scope: _Scope, depth: int, line: int) -> object:
        kind = e[0]
        if kind == "lit":
            return e[1]
        if kind == "dot":
            return _fields(dot, e[1], line)
        if kind == "var":
            return _fields(scope.get(e[1], line), e[2], line)
        if kind == "sub":
            return self._pipe(e[1], dot, scope, depth)
        if kind == "fn":
            return self._command([e], _NOTHING, dot, scope, depth, line)
        raise TemplateError(f"line {line}: unknown operand {e!r}")


def _thunk(evaluate: Callable[[Expr], object], e: Expr) -> Callable[[], object]:
    return lambda: evaluate(e)


def _fields(value: object, names: Sequence[str], line: int) -> object:
    for name in names:
        if value is None:
            raise TemplateError(f"line {line}: nil pointer evaluating interface {{}}.{name}")
        if not isinstance(value, dict):
            raise TemplateError(f"line {line}: can't evaluate field {name} in a {type(value)}")
        value = value.get(name)
    return value
