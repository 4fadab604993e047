"""Imports run down the declared layer order (orbitctl/layers.py); docs/architecture.md shows that order."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path


from orbitctl.layers import LAYERS, layer_of, render

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orbitctl"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names, a relative one resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in the file, at any depth (inside functions too)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
            found.append((node.lineno, module))
            # `from orbitctl import plan` imports the package orbitctl.plan
            if module == "orbitctl":
                found += [(node.lineno, f"orbitctl.{alias.name}") for alias in node.names]
    return found


def back_arrows(package_dir: Path = PACKAGE) -> list[str]:
    """Every import inside ``orbitctl`` that runs up the layer order or sideways between siblings."""
    root = package_dir.parent
    problems = []
    for path in sorted(package_dir.rglob("*.py")):
        here = _module_name(path, root).split(".")
        if len(here) < 2:
            continue  # orbitctl/__init__.py
        source = here[1]
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            if parts[0] != "orbitctl" or len(parts) < 2 or parts[1] == source:
                continue
            target = parts[1]
            if target == "layers":
                continue
            if layer_of(target) >= layer_of(source):
                how = "sideways to a sibling" if layer_of(target) == layer_of(source) else "up"
                problems.append(f"{path.relative_to(root)}:{line}: orbitctl.{source} imports {module} ({how})")
    return problems


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem not in ("__init__", "layers")) or (p / "__init__.py").exists()}
    layered = {name for names in LAYERS for name in names}
    assert parts == layered, f"not in orbitctl/layers.py: {sorted(parts - layered)}; gone: {sorted(layered - parts)}"


def test_every_package_has_an_init():
    missing = [str(d.relative_to(ROOT)) for d in PACKAGE.rglob("*") if d.is_dir() and d.name != "__pycache__"
               and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not missing


def test_imports_point_down():
    assert back_arrows() == []


def test_a_back_arrow_is_caught(tmp_path):
    """The check is not vacuous: a copy of the package with one import added up the order fails it."""
    import shutil

    copy = tmp_path / "orbitctl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "model" / "policy.py"
    target.write_text(target.read_text() + "\n\ndef _late():\n    from orbitctl.rl.trainer import train  # noqa\n")
    sideways = copy / "align" / "floor.py"
    sideways.write_text(sideways.read_text() + "\nfrom orbitctl import rl  # noqa\n")
    problems = back_arrows(copy)
    assert any("model/policy.py" in p and "imports orbitctl.rl.trainer (up)" in p for p in problems), problems
    assert any("align/floor.py" in p and "imports orbitctl.rl (sideways to a sibling)" in p for p in problems), problems
    assert len(problems) == 2, problems


def test_the_architecture_page_shows_the_layers():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "```layers\n" + render() + "\n```" in page, "docs/architecture.md: paste orbitctl.layers.render()"


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports: at the top and inside functions, ``from x
    import y`` read as ``x.y`` where that is a module (else ``x``), an import of ``x.y.z`` read as the longest of
    those names that is a module; ``if TYPE_CHECKING:`` blocks left out (they do not run)."""
    root = package_dir.parent
    files = {_module_name(path, root): path for path in sorted(package_dir.rglob("*.py"))}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in files), None)

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        nodes = [ast.parse(path.read_text(encoding="utf-8"), str(path))]
        while nodes:
            node = nodes.pop()
            if _is_type_checking(node):
                nodes.extend(node.orelse)
                continue
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = _from_module(node, package)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in files else resolve(module))
            nodes.extend(ast.iter_child_nodes(node))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion): every set
    of modules that import each other round a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def test_no_module_is_in_an_import_circle():
    """Not even within a package, nor through an import inside a function: a piece two modules share moves down."""
    assert import_circles(module_graph()) == []


def test_an_import_circle_is_caught(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\nfrom pkg import c\n")
    (package / "b.py").write_text("def late():\n    from pkg.a import late  # noqa\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = module_graph(package)
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == set()
    assert import_circles(graph) == [["pkg.a", "pkg.b"]]


HEAVY = ("transformers", "peft", "deepspeed", "bitsandbytes")
NEEDS_TRANSFORMERS = {"orbitctl.kernels.kv_cache": "its caches are transformers Cache and DynamicLayer subclasses"}


def test_the_kernels_load_no_heavy_library():
    """In a fresh interpreter, ``orbitctl.kernels`` and each of its modules import none of transformers, peft,
    deepspeed, bitsandbytes (torch only), but for the one module named in NEEDS_TRANSFORMERS."""
    modules = sorted(_module_name(p) for p in (PACKAGE / "kernels").glob("*.py") if p.name != "__init__.py")
    modules = ["orbitctl.kernels"] + sorted(modules, key=lambda m: m in NEEDS_TRANSFORMERS)  # those last
    script = (
        "import importlib, json, sys\n"
        f"heavy = {HEAVY!r}\n"
        "loaded = {}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    loaded[name] = sorted(h for h in heavy if h in sys.modules)\n"
        "print(json.dumps(loaded))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert set(loaded) == set(modules)
    for name, heavy in loaded.items():
        allowed = {"transformers"} if name in NEEDS_TRANSFORMERS else set()
        assert set(heavy) <= allowed, f"importing {name} loaded {heavy}"
