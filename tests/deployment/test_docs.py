"""docs/ says what the code does: every config key, serve flag and metric documented (and
nothing documented that does not exist), examples that pass check-config, commands the CLI
accepts, links that lead somewhere."""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deployment import k8s
from deployment.chart import ROOT, Helm, default_values, render
from deployment.generate_docs import DOCS, current, metric_families, sample_metrics, stale
from vgpu_plugin.commands import cli, serve
from vgpu_plugin.commands.settings import FLAGS
from vgpu_plugin.core import allocation
from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.devices import MIB, GpuLimit, PhysicalGpu, plan_node
from vgpu_plugin.core.grant import GpuGrant, Grant, grant
from vgpu_plugin.core.schema import SCHEMA
from vgpu_plugin.node.observe.metrics import serve_metrics

DOC_FILES = [*sorted(DOCS.glob("*.md")), ROOT / "deploy" / "README.md"]


def rows(table: str) -> list[list[str]]:
    """The cells of a generated markdown table, unescaped, header and rule dropped."""
    out = []
    for line in table.splitlines()[2:]:
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
        out.append(
            [c.strip().replace("\\|", "|").replace("&lt;", "<").replace("&gt;", ">") for c in cells]
        )
    return out


def code_blocks(path: Path, lang: str | None = None) -> list[str]:
    text = path.read_text()
    return [
        m.group(2)
        for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)
        if lang is None or m.group(1) == lang
    ]


def test_the_generated_tables_are_up_to_date() -> None:
    assert stale() == [], "run: python tests/deployment/generate_docs.py"


def test_every_config_key_is_documented_as_the_schema_says() -> None:
    table = current("config-keys")
    assert table is not None
    documented = {r[0].strip("`"): r for r in rows(table)}
    assert set(documented) == {spec.path for spec in SCHEMA}
    for spec in SCHEMA:
        _, kind, default, allowed, meaning = documented[spec.path]
        assert kind.startswith(spec.type) and ("required" in kind) == spec.required
        assert default.strip("`") == (spec.default_text or "—")
        assert allowed == (spec.allowed or "—") and meaning == spec.description


def test_every_serve_flag_is_documented_with_its_env_and_default() -> None:
    table = current("serve-flags")
    assert table is not None
    documented = {r[0].strip("`"): r for r in rows(table)}
    assert set(documented) == {f"--{f.name}" for f in FLAGS}
    for f in FLAGS:
        _, env, default, _ = documented[f"--{f.name}"]
        assert env == f"`{f.env}`"
        assert default.strip("`") == (f.default or "—")
    # The real command line takes every one of them.
    argv = ["serve"] + [a for f in FLAGS for a in (f"--{f.name}", "x")]
    args = cli.build_parser().parse_args(argv)
    assert all(getattr(args, f.name.replace("-", "_")) == "x" for f in FLAGS)


def test_every_metric_is_documented_and_exists() -> None:
    text = generate_latest(sample_metrics().registry).decode()
    served = {m.group(1) for m in re.finditer(r"^# TYPE (\S+) (\w+)$", text, re.M)}
    table = current("metrics")
    assert table is not None
    documented = {r[0].strip("`") for r in rows(table)}
    assert documented == served
    prose = (DOCS / "metrics.md").read_text()
    for name in served:  # each one is also explained below the table
        assert prose.count(f"`{name}") >= 2, name


def test_the_metrics_table_is_what_a_scrape_returns() -> None:
    """Each name, type and label set in docs/metrics.md's table, against the series an HTTP
    scrape of the plugin's endpoint returns (the cached, hand-rendered path serve uses)."""
    server, port = serve_metrics("127.0.0.1:0", sample_metrics().registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    scraped = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        scraped[name] = (family.type, ", ".join(f"`{k}`" for k in labels) or "—")
    table = current("metrics")
    assert table is not None
    documented = {r[0].strip("`"): (r[1], r[2]) for r in rows(table)}
    assert documented == scraped
    assert not [n for n in scraped if n.endswith("_created")]


def _config_examples() -> list[tuple[str, str]]:
    out = []
    for path in DOC_FILES:
        for block in code_blocks(path, "yaml"):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and data.get("version") == "v1":
                out.append((path.name, block))
    return out


@pytest.mark.parametrize(("doc", "block"), _config_examples())
def test_config_examples_pass_check_config(doc: str, block: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(block)
    assert cli.main(["check-config", str(path), "--no-nvml", "--gpus", "2"]) == 0


def test_there_are_config_examples_in_the_reference() -> None:
    docs = [doc for doc, _ in _config_examples()]
    assert docs.count("configuration.md") >= 3  # the file, overrides, time-slicing


def _values_examples() -> list[dict[str, Any]]:
    out = []
    for path in DOC_FILES:
        for block in code_blocks(path, "yaml"):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and "config" in data:
                out.append(data)
    return out


def test_values_examples_render_and_their_config_passes(tmp_path: Path) -> None:
    examples = _values_examples()
    assert examples
    for values in examples:
        config = render(values).one("ConfigMap")["data"]["config.yaml"]
        path = tmp_path / "config.yaml"
        path.write_text(config)
        assert cli.main(["check-config", str(path), "--no-nvml"]) == 0


def _set_flags() -> list[tuple[str, str]]:
    out = []
    for path in DOC_FILES:
        for m in re.finditer(r"--set ([\w.]+)=(\S+)", path.read_text()):
            out.append((m.group(1), m.group(2).strip("`)")))
    return out


def _set_commands() -> list[tuple[str, tuple[str, ...]]]:
    """Each documented helm command line (continuations joined, its comment included) or
    inline mention with its --set flags, quoted forms too (--set 'dra.gpus={2,3}')."""
    out = []
    for path in DOC_FILES:
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            sets = tuple(m.group(1) for m in re.finditer(r"--set '?([\w.]+=[^\s'`)]+)'?", line))
            if sets and not any(s.startswith("devicePlugin.") for s in sets):  # not our chart
                out.append((f"{path.name}: {' '.join(sets)}", sets))
    return out


def test_there_are_documented_set_commands() -> None:
    found = [sets for _, sets in _set_commands()]
    assert ("dra.enabled=true", "dra.gpus={2,3}") in found  # docs/dra.md's, numbers to helm
    assert len(found) >= 6


@pytest.mark.parametrize(("where", "sets"), _set_commands(), ids=lambda x: str(x))
def test_documented_set_commands_render_with_real_helm(
    where: str, sets: tuple[str, ...], helm: Helm, tmp_path: Path
) -> None:
    rendered = render(None, helm, sets=sets)
    path = tmp_path / "config.yaml"
    path.write_text(rendered.one("ConfigMap", "vgpu-plugin-config")["data"]["config.yaml"])
    assert cli.main(["check-config", str(path), "--no-nvml"]) == 0, where


def test_helm_set_examples_name_real_values() -> None:
    values = default_values()
    found = _set_flags()
    assert found
    for key, _ in found:
        if key.startswith("devicePlugin."):  # the GPU Operator's chart, not ours
            continue
        node: Any = values
        parts = key.split(".")
        for i, part in enumerate(parts):
            if parts[0] == "config" and i > 0:
                break  # the plugin's config: checked by the examples above
            assert isinstance(node, dict) and part in node, f"--set {key}: no such value"
            node = node[part]


def _cli_lines() -> list[str]:
    out = []
    for path in DOC_FILES:
        for block in code_blocks(path):
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                m = re.search(r"(?:^|-- |\$ )vgpu-plugin (\S.*?)(?:\s+#.*)?$", line.strip())
                if m and "$(" not in line:
                    out.append(m.group(1))
    return out


def test_commands_in_the_docs_are_accepted_by_the_cli() -> None:
    lines = _cli_lines()
    assert len(lines) >= 4
    parser = cli.build_parser()
    for line in lines:
        args = [a for a in shlex.split(line) if not a.startswith("$")]
        if "--node-labels-file" in args:
            args = args[: args.index("--node-labels-file")]
        parser.parse_args(args)  # exits (SystemExit) on an unknown command or flag


def _anchors(path: Path) -> set[str]:
    out = set()
    for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", ""))
        out.add(slug.replace(" ", "-"))
    return out


def test_links_lead_somewhere() -> None:
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.name}: {target}"
            if anchor:
                assert anchor in _anchors(dest), f"{path.name}: {target}"


def test_the_index_lists_every_document() -> None:
    index = (DOCS / "README.md").read_text()
    for path in DOCS.glob("*.md"):
        if path.name != "README.md":
            assert f"]({path.name})" in index, path.name


def test_exit_codes_are_the_plugins() -> None:
    text = (DOCS / "operations.md").read_text()
    assert f"| {serve.EXIT_CONFIG} | configuration |" in text
    assert f"| {serve.EXIT_NODE} | the node |" in text


def test_the_quickstart_pod_is_valid_and_asks_for_the_default_resource() -> None:
    pods = [
        d
        for block in code_blocks(DOCS / "quickstart.md", "yaml")
        if (d := yaml.safe_load(block)) and isinstance(d, dict) and d.get("kind") == "Pod"
    ]
    assert len(pods) == 1
    k8s.validate(pods[0])
    limits = pods[0]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {default_values()["resourceName"]: 1}


def test_kubernetes_objects_in_the_docs_are_valid() -> None:
    objects = [
        d
        for path in DOC_FILES
        for block in code_blocks(path, "yaml")
        if (d := yaml.safe_load(block)) and isinstance(d, dict) and "apiVersion" in d
    ]
    assert {o["kind"] for o in objects} >= {"Pod", "ResourceQuota"}
    for obj in objects:
        k8s.validate(obj)


def test_the_documented_defaults_are_the_charts() -> None:
    text = (DOCS / "quickstart.md").read_text() + (DOCS / "operations.md").read_text()
    ds = render().one("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert "nvidia.com/gpu.present=true" in text and pod["nodeSelector"] == {
        "nvidia.com/gpu.present": "true"
    }
    assert f"maxUnavailable: {ds['spec']['updateStrategy']['rollingUpdate']['maxUnavailable']}" in (
        text
    )


# -- the contracts page ----------------------------------------------------------------------

CONTRACTS = DOCS / "contracts.md"


def table_after(path: Path, heading: str) -> list[list[str]]:
    """The cells of the first markdown table below ``heading`` (a whole heading line)."""
    text = path.read_text()
    start = text.index(f"\n{heading}\n")
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return rows("\n".join(table))


def example(name: str) -> str:
    m = re.search(rf"<!-- example:{name} -->\n```\w*\n(.*?)```", CONTRACTS.read_text(), re.S)
    assert m, f"contracts.md: no example {name}"
    return m.group(1)


def _worked_example(compute: str | None = None) -> allocation.ContainerSpec:
    a = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
    b = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
    gpus = [PhysicalGpu(i, u, "NVIDIA H100 80GB HBM3", 81559 * MIB, i, "", 0) for i, u in
            enumerate((a, b))]  # fmt: skip
    config = parse_config(example("config"))
    if compute is not None:
        config = dataclasses.replace(
            config, sharing=dataclasses.replace(config.sharing, compute=compute)
        )
    plan = plan_node(config, gpus, "node", {})
    g = grant(plan, [f"{b}-1", f"{a}-0", f"{a}-3"], "0193ab12cd34ef56")
    return allocation.container_spec(g, "/usr/local/vgpu", "0.1.0-3f2a9c1e7b04")


def test_the_worked_example_is_what_allocate_answers() -> None:
    spec = _worked_example()
    envs = [tuple(line.split("=", 1)) for line in example("envs").splitlines()]
    assert envs == list(spec.envs.items())
    mounts = [tuple(line.split()) for line in example("mounts").splitlines()]
    assert mounts == [
        (m.container_path, "ro" if m.read_only else "rw", m.host_path) for m in spec.mounts
    ]
    assert example("limits") == spec.limits_text


def test_the_allocate_tables_name_what_the_code_sets() -> None:
    envs = {r[0].strip("`") for r in table_after(CONTRACTS, "### Environment")}
    set_by_code = {re.sub(r"_\d+$", "_<i>", name) for name in _worked_example().envs}
    set_by_code.add("CUDA_DEVICE_SM_LIMIT")  # only when every GPU has the same share
    guaranteed = _worked_example(compute="guaranteed")  # adds the guarantee and the peers
    set_by_code |= {re.sub(r"_\d+$", "_<i>", name) for name in guaranteed.envs}
    assert envs == set_by_code
    root, version, alloc_id, lock_dir = "/r", "1.0-abc", "id0", "/locks"
    gpu = PhysicalGpu(0, "GPU-a", "m", MIB, 0, "", 0)
    limit = GpuLimit("GPU-a", MIB, 100, 25)
    g = Grant(alloc_id, (GpuGrant(gpu, ("GPU-a-0",), limit),), False)
    code = {
        m.container_path: (m.host_path, "ro" if m.read_only else "rw")
        for m in allocation.container_spec(g, root, version, lock_dir).mounts
    }
    documented = {}
    for container, host, mode in table_after(CONTRACTS, "### Mounts"):
        host = host.strip("`").replace("<root>", root).replace("<version>", version)
        host = host.replace("<allocation-id>", alloc_id).replace("<lock-dir>", lock_dir)
        documented[container.strip("`")] = (host, mode)
    assert documented == code


def test_the_shim_variables_are_the_ones_it_reads() -> None:
    documented = {
        re.sub(r"_<i>$", "", r[0].strip("`")) for r in table_after(CONTRACTS, "## Shim environment")
    }
    sources = "".join(p.read_text() for p in (ROOT / "native/libvgpu/src").glob("*.c"))
    read = set(re.findall(r'(?:getenv|env_index)\((?:\*e, )?"(\w+)"', sources))
    assert documented == read


def _repo_texts() -> list[Path]:
    out = [ROOT / "README.md"]
    for top in ("src", "tests", "bench", "native", "deploy", "docs"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix in {".py", ".c", ".h", ".md", ".txt", ".yaml"} and path.is_file():
                out.append(path)
    return out


def test_references_to_the_docs_lead_somewhere() -> None:
    found = 0
    for path in _repo_texts():
        for name, anchor in re.findall(r"docs/([\w-]+\.md)(?:#([\w-]+))?", path.read_text()):
            found += 1
            dest = DOCS / name
            assert dest.exists(), f"{path.relative_to(ROOT)}: docs/{name}"
            if anchor:
                assert anchor in _anchors(dest), f"{path.relative_to(ROOT)}: docs/{name}#{anchor}"
    assert found >= 10


def test_the_contracts_live_in_the_repository() -> None:
    outside = re.compile("DESI" + r"GN(\.md| \d| section)|/work/" + "shared")
    for path in _repo_texts():
        assert not outside.search(path.read_text()), (
            f"{path.relative_to(ROOT)}: use docs/contracts.md"
        )


def _serve_exit_rows() -> list[tuple[int, str]]:
    """(code, 'log line starts with' cell) of operations.md's serve exit-code table."""
    text = (DOCS / "operations.md").read_text()
    table = text.split("### Exit codes of `vgpu-plugin serve`", 1)[1].split("\n\n", 2)[1]
    return [(int(r[0]), r[2]) for r in rows(table)]


@pytest.mark.parametrize(
    ("said", "argv"),
    [
        ("unknown log format", ["serve", "--log-format=xml"]),
        ("unknown log level", ["serve", "--log-level=loud"]),
        ("--cleanup-grace: expected", ["serve", "--cleanup-grace=soon"]),
        ("usage: vgpu-plugin serve", ["serve", "--config"]),
    ],
)
def test_serves_exit_codes_are_the_documented_ones(
    said: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    documented = {code for code, cell in _serve_exit_rows() if said in cell}
    assert len(documented) == 1, f"operations.md: {said!r} in {documented or 'no'} row"
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's usage error, or a message (Python exits 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        rc = exc.code if isinstance(exc.code, int) else 1
    assert rc == documented.pop()
    assert said in capsys.readouterr().err


def test_install_shims_exit_codes_and_keep_0_are_as_documented(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], helm: Helm
) -> None:
    ops = " ".join((DOCS / "operations.md").read_text().split())
    assert "2 for a bad `--keep`" in ops and "`--keep 0` itself is refused, exit 2" in ops
    assert cli.main(["install-shim", "--keep", "0", "--host-root", str(tmp_path / "h")]) == 2
    assert "--keep" in capsys.readouterr().err
    # ... and the chart's keepVersions 0 ("keeps every version") passes no --keep at all.
    rendered = render({"shim": {"keepVersions": 0}}, helm)
    pod = rendered.one("DaemonSet")["spec"]["template"]["spec"]
    init = next(c for c in pod["initContainers"] if "install-shim" in c.get("args", []))
    assert "--keep" not in init["args"]
    pod = render({"shim": {"keepVersions": 2}}, helm).one("DaemonSet")["spec"]["template"]["spec"]
    init = next(c for c in pod["initContainers"] if "install-shim" in c.get("args", []))
    assert init["args"][init["args"].index("--keep") + 1] == "2"


def test_the_limits_file_takes_the_byte_amounts_the_docs_say() -> None:
    from vgpu_plugin.core.devices import GpuLimit
    from vgpu_plugin.core.limits import Limits, format_limits, parse_limits

    doc = " ".join((DOCS / "limits-file.md").read_text().split())
    assert "1,024,000 bytes" in doc and "need not be a MiB multiple" in doc
    # A DRA grant of 1,000 KiB (a 1Ki step): not a MiB multiple, written and read as bytes.
    limits = Limits("claim-a", False, (GpuLimit("GPU-1", 1_024_000, 0),))
    text = format_limits(limits)
    assert "gpu GPU-1 1024000 0\n" in text
    assert parse_limits(text) == limits


def test_the_license_file_is_the_license_the_package_names() -> None:
    # pyproject's license line (no TOML parser: Python 3.10 has none in its library)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = \{ text = "Apache-2.0" \}$', pyproject, re.M)
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for part in ("1. Definitions.", "9. Accepting Warranty", "END OF TERMS AND CONDITIONS"):
        assert part in text  # the full text, not a stub
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in dockerfile


def test_the_changelog_names_every_metric_it_says_was_replaced() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    served = {name for name, _, _, _ in metric_families()}
    assert "vgpu_container_compute_limit_percent" not in served
    assert "`vgpu_container_compute_limit_ratio`" in text
    assert "vgpu_container_compute_limit_ratio" in served


def test_status_and_demo_exit_as_operations_md_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ops = " ".join((DOCS / "operations.md").read_text().split())
    assert "`vgpu-plugin status` exits 1 when its `--state-dir` or `--host-root`" in ops
    assert "and 2 for a bad `--seconds` (above 0)" in ops
    argv = ["status", "--no-nvml", "--state-dir", str(tmp_path / "none")]
    assert cli.main([*argv, "--host-root", str(tmp_path)]) == 1
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--seconds", "0"])
    assert exited.value.code == 2
