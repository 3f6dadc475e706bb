"""piper-ir depends on attrs alone: it imports and works where torch, ray and numpy are absent."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import piper_ir

SOURCE = Path(piper_ir.__file__).parent
ALLOWED = set(sys.stdlib_module_names) | {"attrs", "piper_ir"}

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # any import of these now raises ImportError
    sys.modules["ray"] = None
    sys.modules["numpy"] = None
    import piper_ir
    from piper_ir import (Edge, EdgeKind, Graph, Node, NodeKind, Phase, Segment, SegmentRole, Tags,
                          TensorMeta, ValidationError, Value, from_json, graph_summary, to_json,
                          topological_order, validate)
    meta = TensorMeta((4, 8), "float32", batch_dim=0)
    graph = Graph(
        segments=[Segment("s0", SegmentRole.STAGE, Tags.of(PP=0), ("input:0",), ("v:a",))],
        values=[Value("input:0", meta), Value("v:a", meta)],
        nodes=[Node("F.s0", NodeKind.COMPUTE, "s0", Phase.F, tags=Tags.of(PP=0)),
               Node("B.s0", NodeKind.COMPUTE, "s0", Phase.B, tags=Tags.of(PP=0))],
        edges=[Edge("F.s0", "B.s0", EdgeKind.DATA)],
        inputs=("input:0",),
    )
    assert from_json(to_json(validate(graph))) == graph
    assert topological_order(graph) == ["F.s0", "B.s0"]
    graph_summary(graph)
    try:
        validate(Graph((), (), (), [Edge("x", "y")]))
    except ValidationError:
        pass
    else:
        raise SystemExit("validate accepted a dangling edge")
    assert not any(sys.modules.get(m) for m in ("torch", "ray", "numpy"))
    print("ok")
    """
)


def test_import_and_use_without_torch_ray_numpy() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def test_sources_import_only_stdlib_and_attrs() -> None:
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) >= 5
    offenders = [
        f"{path.name}:{line}: {module}"
        for path in files
        for module, line in _imported_modules(path)
        if module.split(".")[0] not in ALLOWED
    ]
    assert offenders == []


def test_scanner_sees_nested_and_conditional_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch.nn\n\nif False:\n    from numpy import array\n")
    assert [m for m, _ in _imported_modules(bad)] == ["torch.nn", "numpy"]
