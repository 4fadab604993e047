"""Imports run down the declared layer order (orbitctl/layers.py); docs/architecture.md shows that order."""

from __future__ import annotations

import ast
from pathlib import Path


from orbitctl.layers import LAYERS, layer_of, render

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orbitctl"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in the file, at any depth (inside functions too)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
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
