"""Every torch.distributed collective of the package goes through orbitctl/dist/collectives.py, which puts each
tensor on the device its group's backend takes (NCCL: CUDA only). A module that calls one itself fails here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "orbitctl"
HELPER = PACKAGE / "dist" / "collectives.py"
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced",
}
DIST_MODULES = ("torch.distributed", "torch.distributed.nn", "torch.distributed.nn.functional")


def direct_calls(path: Path) -> list[str]:
    """``file:line name`` of each collective ``path`` calls itself: ``dist.X(...)`` where ``dist`` names
    torch.distributed (any alias), ``torch.distributed.X(...)``, or a collective imported by name."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in DIST_MODULES and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in DIST_MODULES:
                imported |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = None
        if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            base = ast.unparse(func.value)
            if base in aliases or base in DIST_MODULES:
                name = f"{base}.{func.attr}"
        elif isinstance(func, ast.Name) and func.id in imported:
            name = func.id
        if name:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_no_module_but_the_helper_calls_a_collective():
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != HELPER for hit in direct_calls(path)]
    assert offenders == [], "call these through orbitctl.dist.collectives:\n" + "\n".join(offenders)


def test_the_check_sees_each_way_of_calling_one(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch.distributed as dist\nimport torch.distributed as d2\n"
        "from torch.distributed import all_gather as gather_all\nfrom torch import distributed\n"
        "from torch.distributed.nn.functional import all_to_all_single\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n    d2.broadcast(t, 0)\n"
        "    gather_all([t], t)\n    distributed.reduce_scatter(t, [t])\n    all_to_all_single(t, t)\n"
        "    dist.get_rank()\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        hits = [h.split(" ", 1)[1] for h in direct_calls(sample)]
    finally:
        PACKAGE = saved
    assert hits == ["dist.all_reduce", "torch.distributed.barrier", "d2.broadcast", "gather_all",
                    "distributed.reduce_scatter", "all_to_all_single"]
