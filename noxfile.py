"""Test, lint and benchmark sessions for the Piper monorepo.

Sessions run inside the one shared virtual environment that ``./dev`` builds (``.venv``), so
they use ``venv_backend="none"`` and call ``sys.executable``; ``standalone`` builds a venv per
package of its own. The default sessions (``./dev test``, what CI runs) are ``lint`` and
``tests``: what ``standalone`` (each package installed alone, with its own tests) and
``integration`` run, every test once, their pytest runs in one queue. ``nox -s all`` runs
every test in the shared venv instead (one pytest run, quicker while developing).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import attrs
import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "tests"]

ROOT = Path(__file__).parent
PACKAGES = ["ir", "semantics", "directives", "scheduler", "memory", "runtime", "train"]
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
    """Strategies on the runtimes against single-device training.

    Two pytest runs side by side, each test in exactly one of them: the tests marked
    ``own_process`` (the command, torchrun, or a cluster of two nodes, started as processes of
    their own: mostly waiting for them to start and stop) and the rest, in this process (on
    the local runtime, and those marked ``ray`` on the session's shared Ray cluster:
    integration/conftest.py). The second, the longer, prints as it runs; the first's output is
    printed whole when it ends."""
    _run_all(session, _integration_jobs(session.posargs), show=True, live="in process")


def _integration_jobs(args: list[str]) -> list[tuple[str, list[Command]]]:
    """``integration``'s two pytest runs, the longer first."""
    runs = [("in process", "not own_process"), ("own_process", "own_process")]
    return [
        (label, [Command([*PYTEST, "-q", "-m", marks, "integration", *args], ok=(0, 5))])
        for label, marks in runs
    ]


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every test once, as ``standalone`` and ``integration`` run them, but their pytest runs
    in one queue, two at a time, the longest first: the integration tests run in this process
    (the longest run), then the runtime package's tests and the
    ``own_process`` integration tests (both mostly waiting on Ray workers and timeouts), then
    the other packages' (computing), the longest first (``LONGEST_FIRST``). Run one after the
    other, the two sessions left a core idle while each one's longest run ended alone: the
    clean-clone suite took 6 min 22 s that way and 6 min 5 s queued, one run each on 2 cores
    minutes apart (this machine's speed moves a run by a minute: the same code took 7 min 6 s
    and 7 min 12 s later the same night). The in-process run starts first, at once: it
    needs only ``.venv``, so it runs while the standalone wheels and environments are made
    (each package's install is the first command of its job; 40 s of the clean-clone run's
    start). The in-process run prints as it runs, every other one whole when it ends."""
    started = time.monotonic()
    integration = _integration_jobs([])
    queue = _Queue(session, show=True, live="in process")
    queue.add(*integration[0])  # needs only .venv: it runs while the standalone wheels and environments are made
    standalone_jobs, report = _standalone_jobs(session, PACKAGES)
    by_label = dict(standalone_jobs)
    for label, commands in [("piper-runtime", by_label.pop("piper-runtime")), integration[1], *by_label.items()]:
        queue.add(label, commands)
    ran = queue.wait()
    report({label: seconds for label, seconds in ran.items() if label.startswith("piper-")}, started)
    session.log("integration: " + "; ".join(f"{label} {sum(ran[label]):.0f} s" for label, _ in integration))


@nox.session(venv_backend="none")
def properties(session: nox.Session) -> None:
    """The cross-pass property tests with 2,000 cases instead of CI's 300 (no processes)."""
    session.env["PIPER_HYPOTHESIS_EXAMPLES"] = session.env.get("PIPER_HYPOTHESIS_EXAMPLES", "2000")
    _pytest(session, "integration/test_properties.py")


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
# Heavy third-party distributions put once each, with their own dependencies, into a
# layer of their own (``.nox/standalone/layers/<name>``) that every standalone environment
# needing one of them sees through a ``.pth`` file (standalone's docstring says why).
LAYERED = ("torch", "numpy", "ray", "matplotlib", "transformers")
JOBS = 2  # commands at once: pip and most tests use one core; CI machines have two or more
# The order packages are tested in side by side: the runtime's first (its tests wait on Ray
# workers and timeouts), then the others longest first (seconds in a clean-clone run: train
# 45, directives 31, scheduler 23, ir 14, memory 7, semantics 5), so that the last to end is
# a short one and neither core idles long at the end.
LONGEST_FIRST = ("runtime", "train", "directives", "scheduler", "ir", "memory", "semantics")


def _dist_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]+)", requirement)[1]).lower()


def _requirements(dist: str, *, extras: bool) -> list[str]:
    project = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    if extras:
        reqs += project.get("optional-dependencies", {}).get("test", [])
    return reqs


def _internal_closure(dist: str) -> list[str]:
    """``dist`` and the piper distributions it or its tests need, transitively (their own
    tests' needs excluded)."""
    return [name for name, _ in _closure(dist)]


def _closure(dist: str) -> list[tuple[str, list[str]]]:
    """The piper distributions ``dist`` or its tests need, transitively, each with the
    requirements it brings (``dist`` its ``test`` extra too; the others not theirs)."""
    out: dict[str, list[str]] = {}
    todo = [(dist, True)]
    while todo:
        name, extras = todo.pop()
        if name in out:
            continue
        out[name] = _requirements(name, extras=extras)
        for req in out[name]:
            m = re.match(r"(piper-[a-z]+)", req)
            if m:
                todo.append((m[1], False))
    return list(out.items())


def _layers_of(dist: str) -> list[str]:
    """The layered distributions that ``dist`` or its tests declare (directly or through a
    piper distribution they need)."""
    names = {_dist_name(req) for _, reqs in _closure(dist) for req in reqs}
    return [layer for layer in LAYERED if layer in names]


def _layer_specs(layer: str) -> list[str]:
    """Every requirement on ``layer`` that any package declares (dependencies and extras):
    the layer's version satisfies them all."""
    specs = set()
    for name in PACKAGES:
        project = tomllib.loads((ROOT / "packages" / f"piper-{name}" / "pyproject.toml").read_text())["project"]
        reqs = project.get("dependencies", []) + [r for rs in project.get("optional-dependencies", {}).values() for r in rs]
        specs.update(r.split(";")[0].strip() for r in reqs if _dist_name(r) == layer)
    return sorted(specs)


def _installed_closure(layer: str) -> list[importlib.metadata.Distribution] | None:
    """``layer`` and every distribution it needs, transitively, as installed in the
    environment running nox (markers evaluated here, extras followed): what ``pip install
    --target`` would put in the layer with these versions. ``None`` if one is missing or has
    no file list."""
    from packaging.requirements import Requirement

    found: dict[str, tuple[importlib.metadata.Distribution, set[str]]] = {}
    todo: list[tuple[str, frozenset[str]]] = [(layer, frozenset())]
    while todo:
        name, extras = todo.pop()
        key = _dist_name(name)
        if key in found and extras <= found[key][1]:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return None
        if dist.files is None:
            return None
        wanted = found.get(key, (dist, set()))[1] | extras
        found[key] = (dist, wanted)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *sorted(wanted))):
                todo.append((req.name, frozenset(req.extras)))
    return [dist for dist, _ in found.values()]


def _satisfies(dist: importlib.metadata.Distribution, specs: list[str]) -> bool:
    from packaging.requirements import Requirement

    return all(Requirement(spec).specifier.contains(dist.version, prereleases=True) for spec in specs)


def _link_layer(dists: list[importlib.metadata.Distribution], target: Path) -> None:
    """Hard-link (copy where that fails) the files of ``dists`` that live in their
    site-packages, each module's compiled ``.pyc`` with it, into ``target``. A file pip
    writes and removes never changes in place, so the link keeps the layer as installed."""
    tag = sys.implementation.cache_tag
    for dist in dists:
        for file in dist.files or []:
            if file.parts[0] == "..":  # console scripts, outside site-packages: no import needs them
                continue
            source = Path(dist.locate_file(file))
            pairs = [(source, target / file)]
            if source.suffix == ".py":
                pyc = Path("__pycache__") / f"{source.stem}.{tag}.pyc"
                pairs.append((source.parent / pyc, (target / file).parent / pyc))
            for src, dst in pairs:
                if not src.is_file() or dst.exists():
                    continue
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)


def _environment_key() -> str:
    """Changes when any package's declared dependencies or the interpreter change: a cached
    environment is then rebuilt from nothing."""
    digest = hashlib.sha256(sys.version.encode())
    for name in PACKAGES:
        digest.update((ROOT / "packages" / f"piper-{name}" / "pyproject.toml").read_bytes())
    return digest.hexdigest()[:16]


@attrs.frozen
class Command:
    """One command of a job: its argv, environment additions, the exit codes that pass, and
    what to do once it passed (``then``: a standalone environment's stamp, written only once
    its install succeeded)."""

    argv: list[str]
    env: dict[str, str] = attrs.field(factory=dict)
    ok: tuple[int, ...] = (0,)
    then: Callable[[], None] | None = None


def _run_all(
    session: nox.Session, jobs: list[tuple[str, list[Command]]], *, show: bool = False, live: str | None = None
) -> dict[str, float]:
    """Run ``jobs`` through a ``_Queue`` (``JOBS`` at a time, in the order given); their
    seconds by label."""
    queue = _Queue(session, show=show, live=live)
    for label, commands in jobs:
        queue.add(label, commands)
    return {label: sum(seconds) for label, seconds in queue.wait().items()}


class _Queue:
    """Jobs (a label and its commands, one after the other, the first failure ending it),
    ``JOBS`` at a time, started in the order they are added: a job added while the queue
    runs others starts as soon as one of them ends, so a caller can start the longest job
    before it has made the others (``tests``). A job's output is printed, whole, when it
    ends: always with ``show``, else only if it failed; the job labelled ``live`` prints as
    it runs instead (progress on a long job). ``wait``: each job's commands' seconds, by
    label; any failure fails the session once every job has ended."""

    def __init__(self, session: nox.Session, *, show: bool = False, live: str | None = None) -> None:
        self.session, self.show, self.live = session, show, live
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=JOBS)
        self.futures: dict[str, Future[tuple[list[float], bool]]] = {}

    def add(self, label: str, commands: list[Command]) -> None:
        if not self.show:
            self.session.log(f"{label}: " + " && ".join(shlex.join(c.argv) for c in commands))
        self.futures[label] = self.pool.submit(self._one, label, commands)

    def wait(self) -> dict[str, list[float]]:
        results = {label: f.result() for label, f in self.futures.items()}
        self.pool.shutdown()
        failed = [label for label, (_, ok) in results.items() if not ok]
        if failed:
            self.session.error(f"failed: {', '.join(failed)} (output above)")
        return {label: seconds for label, (seconds, _) in results.items()}

    def _one(self, label: str, commands: list[Command]) -> tuple[list[float], bool]:
        out, ok, seconds = [], True, []
        for c in commands:
            t0 = time.monotonic()
            if label == self.live:
                self.session.log(f"{label}: {shlex.join(c.argv)}")
                done = subprocess.run(c.argv, env={**os.environ, **c.env})
            else:
                done = subprocess.run(c.argv, capture_output=True, text=True, env={**os.environ, **c.env})
                out.append(f"nox > {shlex.join(c.argv)}\n{done.stdout}{done.stderr}")
            seconds.append(time.monotonic() - t0)
            if done.returncode not in c.ok:
                out.append(f"nox > {label}: exited {done.returncode}\n")
                ok = False
                break
            if c.then is not None:
                c.then()
        if self.show or not ok:
            with self.lock:
                self.session.log(f"{label}: {'done' if ok else 'FAILED'} in {sum(seconds):.0f} s")
                print("".join(out), end="", flush=True)
        return seconds, ok


@nox.session(venv_backend="none")
def standalone(session: nox.Session) -> None:
    """Each package alone: a virtual environment of its own (no system site-packages, not the
    shared .venv) with the package installed from its wheel and only what its pyproject
    declares (dependencies and the ``test`` extra); then tools/standalone_check.py (imports
    only what it declares, every module imports) and the package's own tests.

    Installing torch (with sympy and the rest of its dependencies), numpy, ray and matplotlib
    into every environment that needs them took most of this session (torch alone ~25 s,
    five times), and transformers with its 32 dependencies 25 s of piper-train's environment
    (6 s with the layer), before any test could start. So each of those (``LAYERED``) is put
    once, with its own dependencies, into a layer of its own: hard-linked from the
    environment running nox (``.venv``, which already holds them), the distribution and
    those it needs as installed there (markers and
    extras followed, each module's ``.pyc`` with it: the distributions ``pip install
    --target`` would put there, about a second per layer), or, where a version there does
    not satisfy every package's requirement, by ``pip install --target``. An environment
    whose package declares it (directly, in its ``test`` extra or through a piper
    distribution it needs)
    gets a ``.pth`` file naming that layer *before* pip installs its closure: pip sees the
    layer's distributions as installed (they satisfy the requirement, so it neither replaces
    nor touches them) and installs only the rest. An environment sees nothing it does not
    declare: piper-ir gets no layer at all and cannot import torch, numpy or ray, exactly as
    when everything was installed per environment; the layers hold exactly what pip would
    install there. A layer's version satisfies every package's requirement on it (one
    ``pip install`` of all of them). The environments are made without pip (``venv
    --without-pip``; the shared environment's pip installs into them with ``--python``), so
    they hold only the closure. Layers made by pip, and environments, are installed two at a
    time, and the packages are checked and tested two at a time (the runtime's tests, which
    mostly wait on Ray workers and timeouts, beside the others in turn); the runtime's output
    is printed as it runs, each other one's whole when it ends.

    Layers are cached in .nox/standalone/layers/<name> and rebuilt when a requirement on them,
    the interpreter or (for a linked layer) a version it holds changes; environments in
    .nox/standalone/<package>, rebuilt when a pyproject changes; the piper wheels are rebuilt and reinstalled on every run. ``nox -s
    standalone -- ir scheduler`` checks only those packages."""
    names = session.posargs or PACKAGES
    unknown = sorted(set(names) - set(PACKAGES))
    if unknown:
        session.error(f"unknown packages {unknown}; known: {PACKAGES}")
    started = time.monotonic()
    jobs, report = _standalone_jobs(session, names)
    queue = _Queue(session, show=True, live="piper-runtime" if "runtime" in names else None)
    for label, commands in jobs:
        queue.add(label, commands)
    report(queue.wait(), started)


def _standalone_jobs(
    session: nox.Session, names: list[str]
) -> tuple[list[tuple[str, list[Command]]], Callable[[dict[str, float], float], None]]:
    """Build the wheels, layers and environments of ``names`` (``standalone``'s docstring);
    the check-and-test job of each package, and what logs the timings once they ran."""
    wheels = STANDALONE / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    started = time.monotonic()  # for the wheels' time
    # Built from fresh copies of the packages: setuptools writes its build directory and
    # metadata where it builds (stale files there would enter the wheel), and the tree's own
    # metadata belongs to the editable install the integration tests run from meanwhile.
    copies = STANDALONE / "sources"
    shutil.rmtree(copies, ignore_errors=True)
    sources = []
    for d in sorted({d for n in names for d in _internal_closure(f"piper-{n}")}):
        sources.append(copies / d)
        shutil.copytree(ROOT / "packages" / d, copies / d, ignore=shutil.ignore_patterns(
            "build", "*.egg-info", "__pycache__", ".ruff_cache", ".pytest_cache", ".hypothesis"))
    session.run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
        *map(str, sources), external=True,
    )
    wheel_of = {w.name.split("-")[0].replace("_", "-"): w for w in wheels.glob("*.whl")}
    timings = [f"wheels {time.monotonic() - started:.0f} s"]
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]

    # The layers the chosen packages need, built where missing or stale.
    layers = STANDALONE / "layers"
    needed = [layer for layer in LAYERED if any(layer in _layers_of(f"piper-{n}") for n in names)]
    jobs, keys, linked = [], {}, {}
    for layer in needed:
        specs = _layer_specs(layer)
        dists = _installed_closure(layer)
        if dists is not None and _satisfies(dists[0], specs):  # linked from the shared environment
            versions = sorted(f"{_dist_name(d.metadata['Name'])}=={d.version}" for d in dists)
            linked[layer] = dists
        else:  # installed by pip
            versions = []
        keys[layer] = hashlib.sha256("\n".join([sys.version, *specs, *versions]).encode()).hexdigest()[:16]
        stamp = layers / layer / ".piper-key"
        if stamp.exists() and stamp.read_text() == keys[layer]:
            linked.pop(layer, None)
            continue
        shutil.rmtree(layers / layer, ignore_errors=True)  # the environments that see it are rebuilt too: their key
        shutil.rmtree(layers / f"{layer}.partial", ignore_errors=True)
        if layer not in linked:
            jobs.append((f"layer {layer}", [Command([*pip, "install", "--target", str(layers / f"{layer}.partial"), *specs])]))
    built_layers = {}
    for layer, dists in linked.items():
        t0 = time.monotonic()
        _link_layer(dists, layers / f"{layer}.partial")
        built_layers[f"layer {layer}"] = time.monotonic() - t0
        session.log(f"layer {layer}: linked from this environment ({len(dists)} distributions)")
    built_layers.update(_run_all(session, jobs))
    for label, seconds in built_layers.items():
        layer = label.removeprefix("layer ")
        (layers / f"{layer}.partial").rename(layers / layer)
        (layers / layer / ".piper-key").write_text(keys[layer])
        timings.append(f"{label} {seconds:.0f} s")

    # The environments: new ones get their layers' .pth files here, their closure installed
    # as the first command of the package's job (its stamp written once that succeeded).
    site = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    installs: dict[str, Command] = {}
    built = {}
    for name in names:
        dist = f"piper-{name}"
        venv = STANDALONE / name
        stamp = venv / ".piper-key"
        # The pyprojects, the interpreter and the layers it sees: a rebuilt layer rebuilds it.
        key = "-".join([_environment_key(), *(keys[layer] for layer in _layers_of(dist))])
        closure = [str(wheel_of[d]) + ("[test]" if d == dist else "") for d in _internal_closure(dist)]
        into = [*pip, "--python", str(venv / "bin" / "python"), "install"]
        if stamp.exists() and stamp.read_text() == key:  # same dependencies: only the piper code may have changed
            installs[name] = Command([*into, "--no-deps", "--force-reinstall", *(c.removesuffix("[test]") for c in closure)])
            built[name] = "cached"
        else:
            shutil.rmtree(venv, ignore_errors=True)
            session.run(sys.executable, "-m", "venv", "--without-pip", str(venv), external=True)
            for layer in _layers_of(dist):
                (venv / site / f"_piper_layer_{layer}.pth").write_text(f"{layers / layer}\n")
            installs[name] = Command([*into, *closure], then=functools.partial(stamp.write_text, key))
            built[name] = "built"
            if _layers_of(dist):
                session.log(f"{dist}: layers {', '.join(_layers_of(dist))}")

    # Install, check and test, two packages at a time, in ``LONGEST_FIRST`` order: the runtime's
    # tests wait on Ray workers and timeouts more than they compute, the others compute.
    jobs = []
    env = {"PYTHONNOUSERSITE": "1", "PYTHONPATH": ""}
    for name in sorted(names, key=LONGEST_FIRST.index):
        dist = f"piper-{name}"
        python = str(STANDALONE / name / "bin" / "python")
        jobs.append((dist, [
            installs[name],
            Command([python, str(ROOT / "tools" / "standalone_check.py"), dist], env),
            # Exit code 5 means "no tests collected": not a failure for a package with none yet.
            Command([python, "-m", "pytest", "-p", "no:cacheprovider", "--import-mode=importlib", "-q",
                     f"packages/{dist}/tests"], env, (0, 5)),
        ]))

    def report(ran: dict[str, list[float]], since: float) -> None:
        """``ran``: each package job's commands' seconds (``_Queue.wait``)."""
        for name in names:
            install, *rest = ran[f"piper-{name}"]
            timings.append(f"piper-{name} {built[name]} {install:.0f} s + check/tests {sum(rest):.0f} s")
        session.log("standalone: " + "; ".join(timings) + f"; total {time.monotonic() - since:.0f} s")

    return jobs, report
