"""Test, lint and benchmark sessions for the Piper monorepo.

Sessions run inside the one shared virtual environment that ``./dev`` builds (``.venv``), so
they use ``venv_backend="none"`` and call ``sys.executable``; ``standalone`` builds a venv per
package of its own. The default sessions (``./dev test``, what CI runs) are ``lint``,
``standalone`` (each package installed alone, with its own tests) and ``integration``: every
test runs once. ``nox -s all`` runs every test in the shared venv instead (one pytest run,
quicker while developing).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import time
import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "standalone", "integration"]

ROOT = Path(__file__).parent
PACKAGES = ["ir", "directives", "scheduler", "memory", "runtime", "train"]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--import-mode=importlib"]


def _pytest(session: nox.Session, *paths: str) -> None:
    # Exit code 5 means "no tests collected": not a failure for a package with none yet.
    session.run(*PYTEST, *paths, *session.posargs, success_codes=[0, 5], external=True)


def _package_session(name: str) -> None:
    @nox.session(name=name, venv_backend="none")
    def run(session: nox.Session) -> None:
        _pytest(session, f"packages/piper-{name}/tests")

    run.__doc__ = f"Tests of piper-{name}."


for _name in PACKAGES:
    _package_session(_name)


@nox.session(venv_backend="none")
def integration(session: nox.Session) -> None:
    """Strategies on the Ray runtime against single-device training."""
    _pytest(session, "integration")


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over every package, the integration tests, the benchmarks, the examples and tools; the
    layering rules (which package may import what) are ruff's banned-api per package."""
    session.run(
        sys.executable, "-m", "ruff", "check", "packages", "integration", "benchmarks", "examples", "tools", "noxfile.py",
        external=True,
    )


@nox.session(name="all", venv_backend="none")
def all_(session: nox.Session) -> None:
    """Lint, then every package's tests and the integration tests in one pytest run."""
    lint(session)
    paths = [f"packages/piper-{p}/tests" for p in PACKAGES] + ["integration"]
    _pytest(session, *paths)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks: print tables comparing Piper with torch.distributed.pipelining."""
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        session.run(sys.executable, str(script), *session.posargs, external=True)


STANDALONE = ROOT / ".nox" / "standalone"


def _requirements(dist: str, *, extras: bool) -> list[str]:
    project = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    if extras:
        reqs += project.get("optional-dependencies", {}).get("test", [])
    return reqs


def _internal_closure(dist: str) -> list[str]:
    """``dist`` and the piper distributions it or its tests need, transitively (their own
    tests' needs excluded)."""
    out: list[str] = []
    todo = [(dist, True)]
    while todo:
        name, extras = todo.pop()
        if name in out:
            continue
        out.append(name)
        for req in _requirements(name, extras=extras):
            m = re.match(r"(piper-[a-z]+)", req)
            if m:
                todo.append((m[1], False))
    return out


def _environment_key() -> str:
    """Changes when any package's declared dependencies or the interpreter change: a cached
    environment is then rebuilt from nothing."""
    digest = hashlib.sha256(sys.version.encode())
    for name in PACKAGES:
        digest.update((ROOT / "packages" / f"piper-{name}" / "pyproject.toml").read_bytes())
    return digest.hexdigest()[:16]


@nox.session(venv_backend="none")
def standalone(session: nox.Session) -> None:
    """Each package alone: a virtual environment of its own (no system site-packages, not the
    shared .venv) with the package installed from its wheel and only what its pyproject
    declares (dependencies and the ``test`` extra); then tools/standalone_check.py (imports
    only what it declares, every module imports) and the package's own tests.

    Environments are cached in .nox/standalone/<package> and rebuilt when a pyproject
    changes; the piper wheels are rebuilt and reinstalled on every run. ``nox -s standalone --
    ir scheduler`` checks only those packages."""
    names = session.posargs or PACKAGES
    unknown = sorted(set(names) - set(PACKAGES))
    if unknown:
        session.error(f"unknown packages {unknown}; known: {PACKAGES}")
    wheels = STANDALONE / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    started = time.monotonic()
    sources = [ROOT / "packages" / d for d in sorted({d for n in names for d in _internal_closure(f"piper-{n}")})]
    for source in sources:  # setuptools builds in the tree; stale files there would enter the wheel
        shutil.rmtree(source / "build", ignore_errors=True)
    session.run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
        *map(str, sources), external=True,
    )
    for source in sources:
        shutil.rmtree(source / "build", ignore_errors=True)
    wheel_of = {w.name.split("-")[0].replace("_", "-"): w for w in wheels.glob("*.whl")}
    key = _environment_key()
    timings = [f"wheels {time.monotonic() - started:.0f} s"]
    for name in names:
        dist = f"piper-{name}"
        t0 = time.monotonic()
        venv = STANDALONE / name
        python = venv / "bin" / "python"
        stamp = venv / ".piper-key"
        closure = [str(wheel_of[d]) + ("[test]" if d == dist else "") for d in _internal_closure(dist)]
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        if not (stamp.exists() and stamp.read_text() == key):
            shutil.rmtree(venv, ignore_errors=True)
            session.run(sys.executable, "-m", "venv", str(venv), external=True)
            session.run(*pip, *closure, external=True)
            stamp.write_text(key)
            built = "built"
        else:  # same dependencies: only the piper code may have changed
            session.run(*pip, "--no-deps", "--force-reinstall", *(c.removesuffix("[test]") for c in closure),
                        external=True)
            built = "cached"
        t1 = time.monotonic()
        env = {"PYTHONNOUSERSITE": "1", "PYTHONPATH": ""}
        session.run(str(python), str(ROOT / "tools" / "standalone_check.py"), dist, external=True, env=env)
        session.run(
            str(python), "-m", "pytest", "-p", "no:cacheprovider", "--import-mode=importlib", "-q",
            f"packages/{dist}/tests", external=True, env=env, success_codes=[0, 5],
        )
        timings.append(f"{dist} {built} {t1 - t0:.0f} s + check/tests {time.monotonic() - t1:.0f} s")
    session.log("standalone: " + "; ".join(timings) + f"; total {time.monotonic() - started:.0f} s")
