"""``piper_runtime``'s names load where first used: each resolves to its module's object, the
type checkers' imports name the same ones, and starting the embedded cluster ahead
(``prepare_runtime`` and the cluster code) imports no torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import piper_runtime


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """``name -> (module, name there)`` of the ``if TYPE_CHECKING:`` block of the package's source."""
    tree = ast.parse(Path(piper_runtime.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {alias.asname or alias.name: (node.module, alias.name)
            for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_every_public_name_resolves_to_its_modules_object() -> None:
    imports = _type_checking_imports()
    assert set(imports) == set(piper_runtime.__all__) == set(piper_runtime._MODULE_OF)
    for name, (module, there) in imports.items():
        assert piper_runtime._MODULE_OF[name] == module, name
        assert getattr(piper_runtime, name) is getattr(importlib.import_module(module), there), name
    assert set(piper_runtime.__all__) <= set(dir(piper_runtime))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        piper_runtime.no_such_name  # noqa: B018


def test_starting_the_cluster_ahead_imports_no_torch() -> None:
    code = ("import sys\n"
            "from piper_runtime import ClusterOptions, RunOptions, prepare_runtime\n"
            "import piper_runtime.driver.cluster, piper_runtime.driver.early_workers\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
