"""The import contract of the package's layers, read from the source (every import, also
those inside functions):

- ``core/`` imports only the standard library, PyYAML and itself: it stays pure.
- nothing outside ``sim/`` imports the simulation, except the demo command, and only lazily,
  so the product (and the DaemonSet image, which ships without ``sim/``) never needs it.
- ``kubelet/`` and ``node/`` never import ``commands/``: commands are not libraries.
- ``pynvml`` is imported in one module only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "vgpu_plugin"


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    parent = ".".join(("vgpu_plugin", *path.relative_to(PACKAGE).parent.parts))
    top = {id(n) for n in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(parent.split(".")[: len(parent.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found += [(f"{base}.{a.name}", id(node) in top) for a in node.names]
            found.append((base, id(node) in top))
    return found


def layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name)


def test_the_core_imports_only_the_standard_library_yaml_and_itself() -> None:
    bad = []
    for path in (PACKAGE / "core").rglob("*.py"):
        for module, _ in imports(path):
            root = module.split(".")[0]
            if root in sys.stdlib_module_names or root in ("__future__", "yaml"):
                continue
            if module == "vgpu_plugin.core" or module.startswith("vgpu_plugin.core."):
                continue
            bad.append(f"{path.relative_to(PACKAGE)}: {module}")
    assert bad == []


def test_only_the_demo_command_reaches_the_simulation_and_only_lazily() -> None:
    bad = []
    for path in sources():
        if layer(path) == "sim":
            continue
        for module, top_level in imports(path):
            if not module.startswith("vgpu_plugin.sim"):
                continue
            lazy_demo = path == PACKAGE / "commands" / "demo.py" and not top_level
            if not lazy_demo:
                bad.append(f"{path.relative_to(PACKAGE)}: {module}")
    assert bad == []


def test_libraries_do_not_import_commands() -> None:
    bad = [
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in sources()
        if layer(path) in ("core", "kubelet", "node")
        for module, _ in imports(path)
        if module.startswith("vgpu_plugin.commands")
    ]
    assert bad == []


def test_pynvml_is_imported_in_one_module() -> None:
    users = {
        str(path.relative_to(PACKAGE))
        for path in sources()
        for module, _ in imports(path)
        if module.split(".")[0] == "pynvml"
    }
    assert users == {"node/gpu/nvml.py"}


def test_the_contract_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The checks above would pass vacuously if nested imports were missed."""
    found = imports(PACKAGE / "commands" / "demo.py")
    assert ("vgpu_plugin.sim.demo", False) in found
    assert ("vgpu_plugin.node.host.native", True) in found


def test_the_kubernetes_client_is_imported_in_one_module() -> None:
    """The DRA driver's API-server access is one module; the rest of the plugin never talks
    to the API server (docs/architecture.md)."""
    users = {
        str(path.relative_to(PACKAGE))
        for path in sources()
        for module, _ in imports(path)
        if module.split(".")[0] == "kubernetes"
    }
    assert users == {"node/serving/kubeapi.py"}


def test_the_kubernetes_client_is_imported_only_inside_functions() -> None:
    """It comes with the ``dra`` extra only (pyproject.toml): a top-level import would make
    every module that imports node/serving/kubeapi.py (the DRA driver, serve) need it."""
    top = [
        str(path.relative_to(PACKAGE))
        for path in sources()
        for module, top_level in imports(path)
        if module.split(".")[0] == "kubernetes" and top_level
    ]
    assert top == []


# The "may import" column of docs/architecture.md's table, for the package's own layers.
ALLOWED_LAYERS = {
    "core": {"core"},
    "api": {"api"},
    "node": {"core", "api", "node"},
    "kubelet": {"core", "api", "node", "kubelet"},
    "commands": {"core", "api", "node", "kubelet", "commands"},  # sim: the demo, lazily
}


def test_every_layer_imports_only_the_layers_the_table_allows() -> None:
    """The whole table of docs/architecture.md: imports only run downwards; in particular
    the node never reaches back up into the kubelet clients (PodRef and CheckpointEntry are
    core facts)."""
    bad = []
    for path in sources():
        allowed = ALLOWED_LAYERS.get(layer(path))
        if allowed is None:
            continue
        for module, _ in imports(path):
            parts = module.split(".")
            if parts[0] != "vgpu_plugin" or len(parts) < 2 or parts[1] == "sim":
                continue  # sim: its own test above
            if parts[1] not in allowed and parts[1] in {*ALLOWED_LAYERS, "sim"}:
                bad.append(f"{path.relative_to(PACKAGE)}: {module}")
    assert bad == []


def test_the_table_in_the_docs_is_the_one_checked() -> None:
    doc = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    rows = {
        line.split("|")[1].strip(" `").removeprefix("vgpu_plugin."): line.split("|")[3]
        for line in doc.splitlines()
        if line.startswith("| `vgpu_plugin.")
    }
    assert "everything but `sim`" in rows["commands"]
    for name, allowed in ALLOWED_LAYERS.items():
        if name == "commands":
            continue
        for other in allowed - {name}:
            assert other in rows[name], (name, other, rows[name])
    assert "never the kubelet" in rows["node"], rows["node"]


# docs/architecture.md's table of node's concerns: what each may import of the node's others.
NODE_CONCERNS = {
    "ledger": {"host"},
    "host": {"ledger"},
    "gpu": set[str](),
    "observe": {"ledger", "host", "gpu"},
    "serving": set[str](),
}


def test_the_node_is_split_by_concern_and_each_imports_only_what_the_table_allows() -> None:
    node = PACKAGE / "node"
    loose = sorted(p.name for p in node.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules outside a concern: {loose}"
    assert {p.name for p in node.iterdir() if (p / "__init__.py").exists()} == set(NODE_CONCERNS)
    bad = []
    for concern, allowed in NODE_CONCERNS.items():
        for path in (node / concern).rglob("*.py"):
            for module, _ in imports(path):
                parts = module.split(".")
                if parts[:2] != ["vgpu_plugin", "node"] or len(parts) < 3:
                    continue
                if parts[2] != concern and parts[2] not in allowed:
                    bad.append(f"{path.relative_to(PACKAGE)}: {module}")
    assert bad == []
    doc = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    rows = {
        line.split("|")[1].strip(" `").removeprefix("node."): line.split("|")[3]
        for line in doc.splitlines()
        if line.startswith("| `node.")
    }
    assert set(rows) == set(NODE_CONCERNS)
    for concern, allowed in NODE_CONCERNS.items():
        for other in allowed:
            assert f"node.{other}" in rows[concern], (concern, other)
        if not allowed:
            assert "nothing else" in rows[concern], concern
