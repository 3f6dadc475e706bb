"""Across packages, Piper imports only public names: a package's internals stay its own to
move, rename or split without breaking another package (the front door above all).

The public surface of a package, and all an import from another package may name:

- its top level: the names in its ``__init__``'s ``__all__`` (read from the source; keep it
  a literal list), and the public submodules below;
- ``PUBLIC_SUBMODULES``: the few submodules a package documents as imported on their own
  (a torch-side part of a torch-free package, the checkpoint format, the backend seam, test
  helpers), exactly those (not their submodules); a name from one must not start with ``_``
  and, where the submodule has an ``__all__``, must be in it.

Anything else fails: a name starting with ``_``, a name missing from ``__all__``, or an
import into any other submodule (``piper_runtime.rank.worker``, ``piper_directives.capturing``).
A package that needs such a name from another gets it re-exported from that package's top
level (added to ``__all__``). Every ``.py`` under ``packages/*/src/`` is parsed (``ast``, no
import), function-level and ``TYPE_CHECKING`` imports included; a package importing its own
modules is not checked. Tests, benchmarks and examples may reach inside (not checked).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("piper_ir", "piper_directives", "piper_scheduler", "piper_memory", "piper_runtime", "piper_semantics",
            "piper_train")

#: Submodules public beside the top level, each for a reason a re-export would not serve.
PUBLIC_SUBMODULES: dict[str, frozenset[str]] = {
    # torch-side, imported on its own so that the package stays importable without torch
    "piper_memory": frozenset({"store"}),
    # the package exports nothing at its top level: each module is one rule set
    "piper_semantics": frozenset({"precision", "randomness"}),
    # the backend seam (a plug-in's protocol), the checkpoint format (its names read as
    # ``checkpoint.check``, imported on first use) and test helpers
    "piper_runtime": frozenset({"backends", "checkpoint", "testing"}),
    "piper_scheduler": frozenset({"testing"}),
}


@attrs.frozen
class Violation:
    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def source_dir(package: str) -> Path:
    """``packages/<dist>/src/<package>``."""
    found = sorted(ROOT.glob(f"packages/*/src/{package}"))
    assert len(found) == 1, f"{package}: expected one source directory, found {found}"
    return found[0]


def module_file(module: str) -> Path | None:
    """The source of ``module`` (``pkg`` or ``pkg.sub``), or None where there is none."""
    package, _, rest = module.partition(".")
    base = source_dir(package).joinpath(*rest.split(".")) if rest else source_dir(package)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def declared_all(module: str) -> frozenset[str] | None:
    """The literal ``__all__`` of ``module``'s source, or None where it has none."""
    path = module_file(module)
    if path is None:
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert node.value is not None
            return frozenset(ast.literal_eval(node.value))
    return None


class Surface:
    """What each package exposes (module doc), read once."""

    def __init__(self) -> None:
        self._all: dict[str, frozenset[str] | None] = {}

    def names(self, module: str) -> frozenset[str] | None:
        if module not in self._all:
            self._all[module] = declared_all(module)
        return self._all[module]

    def problems(self, module: str, names: list[str]) -> Iterator[str]:
        """Why importing ``names`` from ``module`` (another package's) is not allowed."""
        package, _, sub = module.partition(".")
        public_subs = PUBLIC_SUBMODULES.get(package, frozenset())
        for name in names:
            if name.startswith("_"):
                yield f"{module}.{name}: a private name"
        if sub and sub not in public_subs:
            yield f"{module}: not a public submodule of {package} (re-export what is needed from {package})"
            return
        if not names:
            return  # ``import pkg`` or ``import pkg.public_sub``
        exported = self.names(module)
        if not sub and exported is None:
            yield f"{package} has no literal __all__ in its __init__ to import {', '.join(names)} from"
            return
        for name in names:
            if name.startswith("_") or name == "*":
                continue
            if not sub and name in public_subs:
                continue  # ``from piper_runtime import backends``: the submodule itself
            if exported is not None and name not in exported:
                yield f"{module}.{name}: not in {module}.__all__"


def violations(path: Path, own: str, surface: Surface, source: str | None = None) -> list[Violation]:
    """The imports of another Piper package in ``path`` (of package ``own``) that reach past its surface."""
    text = path.read_text(encoding="utf-8") if source is None else source
    shown = str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)
    found: list[Violation] = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imports = [(node.module, [alias.name for alias in node.names])]
        elif isinstance(node, ast.Import):
            imports = [(alias.name, []) for alias in node.names]
        else:
            continue
        for module, names in imports:
            package = module.partition(".")[0]
            if package not in PACKAGES or package == own:
                continue
            found.extend(Violation(shown, node.lineno, why) for why in surface.problems(module, names))
    return found


def package_files(package: str) -> list[Path]:
    return sorted(p for p in source_dir(package).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def surface() -> Surface:
    return Surface()


@pytest.mark.parametrize("package", [p for p in PACKAGES if list(ROOT.glob(f"packages/*/src/{p}"))])
def test_imports_of_other_packages_are_public(package: str, surface: Surface) -> None:
    found = [v for path in package_files(package) for v in violations(path, package, surface)]
    assert not found, "imports past another package's public surface (module doc):\n" + "\n".join(map(str, found))


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("from piper_runtime.rank.worker import TORCH_THREADS", "not a public submodule of piper_runtime"),
        ("import piper_runtime.driver.cluster", "not a public submodule of piper_runtime"),
        ("from piper_runtime.backends.cpu import shm_enabled", "not a public submodule"),  # below a public one
        ("from piper_ir import _rebuild", "piper_ir._rebuild: a private name"),
        ("from piper_ir import no_such_name", "piper_ir.no_such_name: not in piper_ir.__all__"),
        ("from piper_runtime.checkpoint import Reader", "piper_runtime.checkpoint.Reader: not in"),
        ("from piper_memory.store import _private", "a private name"),
        ("from piper_memory.store import BucketLayout", None),
        ("from piper_ir import Graph, grad_name", None),
        ("from piper_runtime import backends", None),
        ("import piper_runtime.backends", None),
        ("from piper_train import fit", None),  # the package itself: not checked
        ("from . import loop", None),
        ("import piper_semantics", None),
    ],
)
def test_the_check_itself(line: str, problem: str | None, surface: Surface) -> None:
    """Each kind of import past the surface is caught, and the public ones pass."""
    path = source_dir("piper_train") / "probe.py"  # as if in the front door
    found = violations(path, "piper_train", surface, source=line + "\n")
    if problem is None:
        assert not found, found
    else:
        assert found and problem in str(found[0]), found
