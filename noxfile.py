"""Test, lint and benchmark sessions for the Piper monorepo.

Sessions run inside the one shared virtual environment that ``./dev`` builds (``.venv``), so
they use ``venv_backend="none"`` and call ``sys.executable``. ``nox -s all`` is the whole
suite, the command CI runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["all"]

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
    """ruff over every package, the integration tests, the benchmarks and the examples."""
    session.run(sys.executable, "-m", "ruff", "check", "packages", "integration", "benchmarks", "examples", "noxfile.py",
                external=True)


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
