"""``piper check`` under ``torchrun`` on every library schedule and on DP x ZeRO-3, TP and EP,
against the same check under ``--runtime local``: both must pass, and their ``--json``
documents must be equal (every loss, gradient and parameter difference from single-device
training alike, so the two runtimes computed the same numbers).

Too slow for the test suite on a 2-core machine (a launch of 2-4 processes per case, each
capturing and compiling; ``integration/test_torchrun.py`` keeps one case of each kind there);
run it when the torchrun runtime changes:

    .venv/bin/python tools/torchrun_matrix.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (name, ranks, flags after --model)
CASES = [
    ("gpipe", 2, ["mlp", "--schedule", "gpipe", "--pp", "2"]),
    ("1f1b", 2, ["mlp", "--schedule", "1f1b", "--pp", "2"]),
    ("interleaved_1f1b", 2, ["mlp", "--schedule", "interleaved_1f1b", "--pp", "2", "--stages", "4"]),
    ("zb1p", 2, ["mlp", "--schedule", "zb1p", "--pp", "2"]),
    ("dualpipe", 2, ["mlp", "--schedule", "dualpipe", "--pp", "2"]),
    ("dualpipev", 2, ["mlp", "--schedule", "dualpipev", "--pp", "2", "--stages", "4"]),
    # SGD: in fp32, AdamW moves an element whose gradient is ~0 by its learning rate either way,
    # as rounding decides, which check cannot tell from a bug (the same under every runtime).
    ("1f1b-dp2-zero3", 4, ["transformer", "--schedule", "1f1b", "--pp", "2", "--dp", "2", "--zero", "3",
                           "--optimizer", "sgd"]),
    ("tp2", 2, ["transformer", "--schedule", "1f1b", "--pp", "1", "--tp", "2", "--optimizer", "sgd"]),
    ("ep2", 4, ["moe", "--schedule", "gpipe", "--pp", "2", "--ep", "2"]),
]
COMMON = ["--microbatches", "4", "--steps", "2", "--json"]


def _env() -> dict[str, str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return env


def _run(command: list[str]) -> tuple[int, list[dict], float]:
    started = time.perf_counter()
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    docs = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
    return done.returncode, docs, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    print("| case | ranks | local | torchrun | documents equal | launch (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    failed = 0
    for name, ranks, flags in CASES:
        if args.only and name not in args.only:
            continue
        check = ["-m", "piper_train", "check", "--model", *flags, *COMMON]
        local_rc, local, _ = _run([sys.executable, *check, "--runtime", "local"])
        spmd_rc, spmd, seconds = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       f"--nproc-per-node={ranks}", *check, "--runtime", "torchrun"])
        equal = len(spmd) == 1 and spmd == local
        ok = local_rc == spmd_rc == 0 and equal
        failed += not ok
        print(f"| {name} | {ranks} | exit {local_rc} | exit {spmd_rc} | {equal} | {seconds:.1f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
