"""Run by ``nox -s standalone`` inside one package's own virtual environment.

``python tools/standalone_check.py piper-scheduler`` checks that the *installed* (not
editable) package

1. is the copy in this environment's site-packages, with the version its source declares;
2. imports, in every source file, only the standard library, itself and the distributions its
   metadata declares: its dependencies and its extras, not the ``test`` extra (the
   environment also holds what the tests need, which must not leak into the package);
3. imports module by module, except modules that need an extra this environment lacks and
   ``__main__`` modules (importing one runs the program).

Standard library only: it runs before anything but the package is known to work.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import pkgutil
import re
import sys
import sysconfig
from pathlib import Path

# Distributions whose import name is not their normalised name and that may be absent here.
IMPORT_NAMES = {"cupy-cuda12x": {"cupy"}}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_modules(dist: str) -> tuple[set[str], set[str]]:
    """Top-level import names of ``dist``'s dependencies, and of its optional extras."""
    by_dist: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for d in dists:
            by_dist.setdefault(_norm(d), set()).add(module)
    required: set[str] = set()
    optional: set[str] = set()
    for req in md.requires(dist) or []:
        spec, _, marker = req.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra and extra[1] == "test":
            continue
        name = _norm(re.match(r"[A-Za-z0-9._-]+", spec.strip())[0])
        modules = by_dist.get(name) or IMPORT_NAMES.get(name) or {name.replace("-", "_")}
        (optional if extra else required).update(modules)
    return required, optional


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """Absolute imports anywhere in ``path`` (inside functions too): (top-level name, line)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def main(dist: str) -> int:
    name = dist.replace("-", "_")
    package = importlib.import_module(name)
    root = Path(package.__file__).parent
    site = Path(sysconfig.get_paths()["purelib"])
    errors = []
    if site not in root.parents:
        errors.append(f"{name} comes from {root}, not from this environment's {site}")
    version = md.version(dist)
    if getattr(package, "__version__", None) != version:
        errors.append(f"{name}.__version__ is {getattr(package, '__version__', None)!r}, its metadata says {version}")
    required, optional = declared_modules(dist)
    allowed = set(sys.stdlib_module_names) | required | optional | {name}
    for path in sorted(root.rglob("*.py")):
        for module, line in imported_modules(path):
            if module not in allowed:
                errors.append(f"{path.relative_to(root.parent)}:{line} imports {module}, which {dist} does not declare")
    count = skipped = 0
    for info in pkgutil.walk_packages(package.__path__, f"{name}."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # importing a __main__ runs the program; its imports are checked above
        try:
            importlib.import_module(info.name)
            count += 1
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] in optional - required:
                skipped += 1  # needs an extra that is not installed here
            else:
                errors.append(f"{info.name} does not import: {err}")
        except Exception as err:  # report every module, not just the first
            errors.append(f"{info.name} does not import: {type(err).__name__}: {err}")
    for e in errors:
        print(f"standalone {dist}: {e}", file=sys.stderr)
    extra = f", {skipped} skipped for a missing extra" if skipped else ""
    if errors:
        print(f"standalone {dist} {version}: FAILED, {len(errors)} problems above ({count} modules import{extra})")
        return 1
    print(f"standalone {dist} {version}: {count} modules import{extra}; imports only declared distributions")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
