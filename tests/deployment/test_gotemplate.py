"""The template renderer the chart tests stand on: Go/Helm semantics of the subset it supports,
and a loud refusal of everything else."""

from __future__ import annotations

import re

import pytest

from deployment.gotemplate import ChartFail, Template, TemplateError, go_float, to_yaml


def render(source: str, values: object = None, **defines: str) -> str:
    t = Template()
    for name, text in defines.items():
        t.add(name, text)
    t.add("main", source)
    return t.render("main", {"Values": values or {}})


def test_trim_markers_eat_whitespace_on_their_side_only() -> None:
    assert render("a  {{- 1 }}  b") == "a1  b"
    assert render("a  {{ 1 -}}  \n b") == "a  1b"
    assert render("x\n  {{- /* gone */ -}}\n  y") == "xy"
    assert render("{{-3}}") == "-3"  # a negative number, not a trim marker


def test_missing_keys_print_nothing_and_fields_of_nil_fail() -> None:
    assert render("[{{ .Values.absent }}]") == "[]"
    with pytest.raises(TemplateError, match=re.escape("nil pointer evaluating interface {}.b")):
        render("{{ .Values.a.b }}")


def test_numbers_print_as_helm_prints_float64_values() -> None:
    assert render("{{ .Values.n }}", {"n": 9400}) == "9400"
    assert render("{{ .Values.n }}", {"n": 1000000}) == "1e+06"
    assert render("{{ .Values.n }}", {"n": 1.0}) == "1"
    assert [go_float(x) for x in (0.5, 123456.0, 1234567.0, 0.0001, 0.00001)] == [
        "0.5",
        "123456",
        "1.234567e+06",
        "0.0001",
        "1e-05",
    ]
    assert to_yaml({"a": 1.0, "b": 0.5, "c": [2.0]}) == "a: 1\nb: 0.5\nc:\n- 2"


def test_if_else_with_range_and_variables() -> None:
    src = (
        "{{ if .Values.x }}x{{ else if .Values.y }}y{{ else }}none{{ end }}|"
        "{{ with .Values.m }}{{ .k }}{{ else }}no m{{ end }}|"
        "{{ range $k, $v := .Values.m }}{{ $k }}={{ $v }};{{ end }}|"
        "{{ range .Values.l }}[{{ . }}]{{ else }}empty{{ end }}|"
        "{{ $a := .Values.m.k }}{{ $a }}{{ $a = 'x' | quote }}"
    )
    with pytest.raises(TemplateError):  # single quotes are Go runes, not strings
        render(src, {})
    src = src.replace("'x'", '"x"') + "{{ $a }}"
    assert render(src, {"y": 1, "m": {"k": "v", "a": "b"}, "l": []}) == ('y|v|a=b;k=v;|empty|v"x"')
    assert render("{{ if .Values.zero }}t{{ else }}f{{ end }}", {"zero": 0}) == "f"


def test_variables_end_with_their_block() -> None:
    with pytest.raises(TemplateError, match="undefined variable"):
        render("{{ if true }}{{ $x := 1 }}{{ end }}{{ $x }}")


def test_define_include_and_indentation() -> None:
    helpers = '{{- define "lbl" -}}\na: 1\nb: {{ .n }}\n{{- end }}'
    out = render('x:\n  {{- include "lbl" .Values | nindent 2 }}', {"n": 2}, h=helpers)
    assert out == "x:\n  a: 1\n  b: 2"
    with pytest.raises(TemplateError, match="no template"):
        render('{{ include "missing" . }}')


def test_helm_functions() -> None:
    v = {"s": "", "t": "abc-", "m": {"a": {"b": 3}}, "n": 60}
    assert render('{{ .Values.s | default "d" }}', v) == "d"
    assert render("{{ .Values.n | quote }}", v) == '"60"'
    assert render('{{ .Values.t | trimSuffix "-" | trunc 2 }}', v) == "ab"
    assert render('{{ dig "a" "b" 0 .Values.m }}/{{ dig "a" "x" "no" .Values.m }}', v) == "3/no"
    assert render('{{ printf "%s:%s" "a" (toString .Values.n) }}', v) == "a:60"
    assert render('{{ hasKey .Values.m "a" }} {{ contains "bc" .Values.t }}', v) == "true true"
    assert render('{{ dir "/etc/x/labels" }} {{ base "/etc/x/labels" }}') == "/etc/x labels"
    assert render("{{ and .Values.n .Values.s }}|{{ or .Values.s .Values.n }}", v) == "|60"


def test_and_or_short_circuit_as_in_go() -> None:
    assert render("{{ if and .Values.a .Values.a.b }}y{{ else }}n{{ end }}") == "n"


def test_fail_and_required_stop_the_rendering() -> None:
    with pytest.raises(ChartFail, match="set one"):
        render('{{ fail "set one" }}')
    with pytest.raises(ChartFail, match="need x"):
        render('{{ required "need x" .Values.x }}')


def test_outside_the_subset_is_refused() -> None:
    for source in (
        "{{ lookup 1 }}",  # unknown function
        '{{ block "x" . }}{{ end }}',
        "{{ if .Values.x }}",  # no end
        "{{ eq .Values.n 1 }}",  # numbers in eq: Go refuses float64 vs int
        "{{ .Values.m }}",  # printing a map
        "{{ (.Values).x }}",
    ):
        with pytest.raises(TemplateError):
            render(source, {"n": 1, "m": {"a": 1}})
