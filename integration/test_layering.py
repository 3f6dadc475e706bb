"""The layering rules of docs/design.md are enforced by ruff (``banned-api`` in each package's
ruff.toml, run by ``nox -s lint``); this checks that configuration: an import the rules
forbid is reported in exactly the files where it is forbidden.

Each case feeds one import line to ``ruff check --stdin-filename <path>``, so ruff applies
the configuration of that path without any file being written.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SRC = "packages/piper-{0}/src/piper_{0}/probe.py"
TESTS = "packages/piper-{0}/tests/test_probe.py"

CASES = [
    # piper_ir: the standard library and attrs only
    ("ir", "import torch", True),
    ("ir", "import numpy", True),
    ("ir", "import ray", True),
    ("ir", "from piper_scheduler import verify", True),
    ("ir", "from piper_memory.plan import plan_memory", True),
    ("ir", "import attrs", False),
    ("ir", "from piper_semantics.randomness import seeded", True),
    # piper_semantics: torch and piper_ir only, below the directives and the runtime that both use it
    ("semantics", "import torch", False),
    ("semantics", "from piper_ir import rng_seed", False),
    ("semantics", "import ray", True),
    ("semantics", "from piper_directives import Place", True),
    ("semantics", "from piper_scheduler import verify", True),
    ("semantics", "from piper_memory import plan_memory", True),
    ("semantics", "from piper_runtime.rank.compute import Executor", True),
    ("semantics", "from piper_train import Trainer", True),
    # piper_scheduler: no torch, no ray, no other package but piper_ir
    ("scheduler", "import torch.nn", True),
    ("scheduler", "import ray", True),
    ("scheduler", "from piper_directives import Place", True),
    ("scheduler", "from piper_memory import plan_memory", True),
    ("scheduler", "from piper_runtime import Runtime", True),
    ("scheduler", "from piper_ir import Program", False),
    ("scheduler", "from piper_semantics.precision import cast_forward", True),
    # piper_runtime: never the directives, the scheduler or the front door; ray and torch are its own
    ("runtime", "from piper_directives import Place", True),
    ("runtime", "from piper_scheduler import verify", True),
    ("runtime", "from piper_train import Trainer", True),
    ("runtime", "import ray", False),
    ("runtime", "from piper_memory.store import shard_tensor", False),
    ("runtime", "from piper_semantics.randomness import seeded", False),
    # piper_memory: torch only in store.py
    ("memory", "import torch", True),
    ("memory", "from piper_scheduler import verify", True),
    ("memory", "import ray", True),
    ("memory", "from piper_semantics.precision import cast_forward", True),
    # piper_directives: no ray, no scheduler, memory or runtime
    ("directives", "import ray", True),
    ("directives", "from piper_scheduler import compile_program", True),
    ("directives", "from piper_memory import plan_memory", True),
    ("directives", "import torch", False),
    ("directives", "from piper_semantics.precision import cast_forward", False),
    # piper_train, the front door, composes everything
    ("train", "import ray", False),
    ("train", "from piper_scheduler import compile_program", False),
]

# piper_train.tuning: the search is torch-free, the profiler and the API are not
TUNING = "packages/piper-train/src/piper_train/tuning/{}.py"
TUNING_CASES = [
    ("search", "import torch", True),
    ("space", "import ray", True),
    ("costs", "from torch import nn", True),
    ("search", "from piper_scheduler import simulate", False),
    ("profiler", "import torch", False),
    ("api", "import ray", False),
]


def _banned(path: str, line: str) -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "TID251", "--stdin-filename", path, "-"],
        input=line + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return "TID251" in proc.stdout


@pytest.mark.parametrize(("package", "line", "banned"), CASES, ids=[f"{p}: {line}" for p, line, _ in CASES])
def test_layering_rule(package: str, line: str, banned: bool) -> None:
    assert _banned(SRC.format(package), line) is banned


@pytest.mark.parametrize(("module", "line", "banned"), TUNING_CASES, ids=[f"{m}: {line}" for m, line, _ in TUNING_CASES])
def test_tune_search_is_torch_free(module: str, line: str, banned: bool) -> None:
    assert _banned(TUNING.format(module), line) is banned


def test_memory_store_may_import_torch() -> None:
    assert not _banned("packages/piper-memory/src/piper_memory/store.py", "import torch")


@pytest.mark.parametrize("package", ["scheduler", "memory", "directives", "semantics"])
def test_tests_may_import_what_their_test_extra_declares(package: str) -> None:
    assert not _banned(TESTS.format(package), "import torch")
