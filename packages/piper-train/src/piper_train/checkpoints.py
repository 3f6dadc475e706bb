"""Checkpoint directories: atomic writes, the latest complete one, keeping the last few.

A checkpoint root holds one directory per checkpoint, ``step-00000040``: the ranks' tensors
(``rank-<r>.safetensors``) and ``index.json`` (``piper_runtime.checkpoint``), and ``piper.json``,
a manifest naming the format, the step, every parameter's shape and the optimizer. Every file
is data: reading a checkpoint runs no code from it (docs/reliability.md, trust model). A
checkpoint is written into a hidden sibling ``.tmp-step-...`` and renamed into
place only when every rank's files, the index and the manifest are on disk, so a crash
while writing leaves a ``.tmp-`` directory that nothing reads, never a checkpoint that looks
complete. A rename never replaces an existing checkpoint, and older checkpoints are deleted
(beyond the newest ``keep``) only after a new one is complete; so are the temporary directories
a writer of this host left when it died (their names say which process wrote them).

Under torchrun every process of the job writes its rank's files into one temporary directory,
whose name all derive alike (``writer``: the coordinator's process, ``Runtime.writer``); only
the coordinator (rank 0) writes the index and manifest, renames, and prunes, once every rank's
files are written (the gather of the ranks' writes is that barrier).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from piper_ir import CheckpointError
from piper_runtime.checkpoint import INDEX, check, read_model, read_objects

FORMAT = "piper-checkpoint"
# 1: torch.distributed.checkpoint files (pickles: refused, ``LEGACY``); 2: safetensors and JSON.
VERSION = 2
LEGACY = (".metadata", "__0_0.distcp")
MANIFEST = "piper.json"
UNTRACED = "untraced_parameters"  # the driver's object: parameters forward never uses, by name
_STEP_DIR = re.compile(r"^step-(\d+)$")
# A temporary directory of a checkpoint being written (or deleted): ``.tmp-[deleting-]<name>-<pid>@<host>-<8 hex>``.
_PARTIAL = re.compile(r"^\.tmp-(?:deleting-)?step-\d+-(\d+)@(.+)-[0-9a-f]{8}$")
log = logging.getLogger("piper_train.checkpoints")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint (renamed into place: index and manifest in it;
    a temporary directory never is, it has no manifest until just before the rename)."""
    return (path / MANIFEST).is_file() and (path / INDEX).is_file()


def is_legacy(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of the earlier format (torch distributed checkpoint),
    which Piper no longer reads: its ``.metadata`` and objects are pickles."""
    return any((path / name).exists() for name in LEGACY) and not (path / INDEX).exists()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints under ``root``, oldest first."""
    return [(step, path) for step, path, why in _step_dirs(root) if why is None]


def _step_dirs(root: Path) -> list[tuple[int, Path, str | None]]:
    """``(step, path, why it is not a checkpoint to load, or None)`` of the ``step-N``
    directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child, _incomplete(child)))
    return sorted(found)


def _incomplete(path: Path) -> str | None:
    if is_legacy(path):
        return "written by an earlier Piper in a format whose files are pickles"
    missing = [name for name in (MANIFEST, INDEX) if not (path / name).is_file()]
    return f"no {' or '.join(missing)} (damaged, or cut short by hand)" if missing else None


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def skipped_newer(root: Path) -> list[tuple[Path, str]]:
    """The ``step-N`` directories under ``root`` newer than its latest complete checkpoint,
    each with why it is not one: what resuming passes over, which the user is told."""
    dirs = _step_dirs(root)
    done = [step for step, _, why in dirs if why is None]
    last = done[-1] if done else -1
    return [(path, why) for step, path, why in dirs if why is not None and step > last]


def resolve(path: str | os.PathLike[str], purpose: str = "resume from") -> Path:
    """The checkpoint ``path`` names: itself when it is one, else the latest complete one
    under it; ``CheckpointError`` when there is none ("nothing to ``purpose``"), or when the
    newest is of the earlier, pickled format (``legacy_error``). Newer directories passed over
    are logged with the reason (``skipped_newer``)."""
    path = Path(path)
    if is_legacy(path):
        raise legacy_error(path)
    if is_complete(path):
        return path
    if (path / MANIFEST).exists() or (path / INDEX).exists() or (_STEP_DIR.match(path.name) and path.is_dir()):
        raise CheckpointError(f"{path} is not a complete checkpoint ({_incomplete(path)})")
    skipped = skipped_newer(path)
    legacy = [p for p, why in skipped if is_legacy(p)]
    if legacy:
        raise legacy_error(legacy[-1])
    latest = latest_checkpoint(path)
    if latest is None:
        what = "does not exist" if not path.exists() else "holds no complete checkpoint"
        reasons = "".join(f"; {p.name}: {why}" for p, why in skipped)
        raise CheckpointError(f"nothing to {purpose}: {path} {what}{reasons}")
    for newer, why in skipped:
        log.warning("%s %s, not from %s: %s", purpose, latest, newer.name, why)
    return latest


def legacy_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} was written by an earlier Piper as a torch distributed checkpoint, whose .metadata and objects "
        "are pickles: torch's reader can run any code their author put there, so this Piper does not use it. "
        f"Convert it once (read as data, through an allow-list): piper convert-checkpoint {path} --out DIR"
    )


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, checked for format and version."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file}: not a readable checkpoint manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a Piper checkpoint manifest")
    if manifest.get("version") == 1 and is_legacy(path):
        raise legacy_error(path)
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{file}: checkpoint format version {manifest.get('version')}, this Piper reads {VERSION}")
    return manifest


def read_checked(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, and its index checked against its files (headers
    only): a damaged or missing file is a ``CheckpointError`` naming it before any rank reads."""
    manifest = read_manifest(path)
    check(path)
    return manifest


def check_compatible(path: Path, manifest: Mapping[str, Any], params: Mapping[str, tuple[int, ...]],
                     optimizer: str) -> None:
    """``CheckpointError`` naming the culprit when checkpoint ``path`` was saved from another
    model (parameter names or shapes differ) or with another optimizer. A tied parameter's
    other names (the manifest's ``ties``) hold nothing of their own: neither side's count."""
    aliases = set(manifest.get("ties", {}))
    params = {name: shape for name, shape in params.items() if name not in aliases}
    saved = {name: tuple(shape) for name, shape in manifest.get("parameters", {}).items() if name not in aliases}
    missing = sorted(set(params) - set(saved))
    extra = sorted(set(saved) - set(params))
    shapes = [f"{n}: {list(params[n])} here, {list(saved[n])} saved" for n in sorted(set(params) & set(saved))
              if tuple(params[n]) != saved[n]]
    problems = []
    if missing:
        problems.append(f"parameters missing from the checkpoint: {', '.join(missing[:5])}"
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if extra:
        problems.append(f"parameters the model does not have: {', '.join(extra[:5])}"
                        + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    if shapes:
        problems.append("shapes differ: " + "; ".join(shapes[:5]))
    if problems:
        raise CheckpointError(f"checkpoint {path} was saved from another model: " + "; ".join(problems))
    if manifest.get("optimizer") not in (None, optimizer):
        raise CheckpointError(
            f"checkpoint {path} holds {manifest['optimizer']} optimizer state; this run uses {optimizer}"
        )


def write_atomically(path: Path, write: Callable[[Path], None], manifest: Mapping[str, Any], *,
                     writer: str | None = None, coordinator: bool = True) -> Path:
    """Write a checkpoint to ``path`` (which must not exist): ``write(tmp)`` fills a fresh
    temporary sibling, the manifest goes in last, then one rename makes it visible. On any
    failure the temporary directory is removed and nothing else is touched. ``writer``,
    ``coordinator``: the processes of a launched job share the temporary directory, and only
    the coordinator completes (or removes) it (module doc)."""
    tmp = begin_atomically(path, writer)
    try:
        write(tmp)
    except BaseException:
        if coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return complete_atomically(tmp, path, manifest) if coordinator else path


def begin_atomically(path: Path, writer: str | None = None) -> Path:
    """The fresh temporary sibling a checkpoint to ``path`` is written into (``CheckpointError``
    when ``path`` exists: a checkpoint is never overwritten). ``writer``: the name every process
    of a launched job gives it (``<pid>@<host>-<8 hex>`` of the coordinator), made by whichever
    comes first."""
    if path.exists():
        raise CheckpointError(f"{path} already exists: a checkpoint is never overwritten")
    path.parent.mkdir(parents=True, exist_ok=True)
    if writer is not None:
        tmp = path.parent / f".tmp-{path.name}-{writer}"
        tmp.mkdir(exist_ok=True)
        return tmp
    tmp = path.parent / f".tmp-{path.name}-{_writer()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def complete_atomically(tmp: Path, path: Path, manifest: Mapping[str, Any]) -> Path:
    """The manifest into ``tmp`` (fsynced), then one rename to ``path``; on failure ``tmp`` is
    removed."""
    try:
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, **manifest}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)  # atomic on one filesystem; fails (rather than replacing) if path appeared
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)
    return path


class Writing(Protocol):
    """The workers' side of a checkpoint being written (``piper_runtime.PendingSave``)."""

    def done(self) -> bool: ...

    def wait(self, timeout_s: float = ...) -> None: ...

    def abandon(self) -> None: ...


class PendingCheckpoint:
    """A checkpoint the ranks are writing into a temporary sibling of ``path`` while training
    goes on (``Trainer.begin_checkpoint``): ``done()`` says whether ``finish`` would return at
    once; ``finish()`` waits, writes the manifest and renames, returning ``path``; ``abandon()``
    (after the workers failed) removes the temporary directory. ``staged_seconds``: how long
    the steps waited for it (the ranks copying what they hold). ``coordinator``: whether this
    process completes and removes it (not a launched job's other processes: module doc)."""

    def __init__(self, path: Path, tmp: Path, manifest: Mapping[str, Any], writing: Writing,
                 staged_seconds: float, coordinator: bool = True) -> None:
        self.path = path
        self.tmp = tmp
        self.manifest = dict(manifest)
        self.writing = writing
        self.staged_seconds = staged_seconds
        self.coordinator = coordinator
        self.started = time.perf_counter() - staged_seconds

    def done(self) -> bool:
        return self.writing.done()

    def finish(self, timeout_s: float = 300.0) -> Path:
        try:
            self.writing.wait(timeout_s)
        except BaseException:
            if self.coordinator:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return complete_atomically(self.tmp, self.path, self.manifest) if self.coordinator else self.path

    def abandon(self) -> None:
        self.writing.abandon()
        if self.coordinator:
            shutil.rmtree(self.tmp, ignore_errors=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``, and what dead
    writers left (``abandoned``); the checkpoints deleted."""
    if keep < 1:
        return []
    old = [path for _, path in complete_checkpoints(root)[:-keep]]
    for path in old:
        # Rename first, so a crash half-way through the delete leaves no partial checkpoint
        # under a checkpoint's name.
        doomed = path.parent / f".tmp-deleting-{path.name}-{_writer()}-{uuid.uuid4().hex[:8]}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for path in abandoned(root):
        shutil.rmtree(path, ignore_errors=True)
    return old


def abandoned(root: Path) -> list[Path]:
    """The temporary directories under ``root`` whose writer died: made by a process of this
    host that no longer runs (killed while writing a checkpoint, or while deleting one). Those
    of other hosts (a shared filesystem), of live processes, or named otherwise stay."""
    host = socket.gethostname()
    found = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        m = _PARTIAL.match(child.name)
        if m and m.group(2) == host and not _running(int(m.group(1))):
            found.append(child)
    return found


def _writer() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say: it exists
        return True
    return True


def export(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Write the model of checkpoint ``path`` (or the latest under it) to ``out`` as a plain
    single-device ``state_dict``, which ``model.load_state_dict`` accepts: a safetensors file
    when ``out`` ends in ``.safetensors`` (tied parameters under each name, as copies: the
    format keeps no shared storage), else ``torch.save``'s format."""
    state = model_state_dict(path)
    save_atomically(state, Path(out))
    return state


def model_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model of checkpoint ``path`` (or the latest under it) as a single-device
    ``state_dict``: every name the model has, tied parameters under each of theirs."""
    source = resolve(path, "export")
    manifest = read_checked(source)
    state = read_model(str(source))
    if manifest.get("untraced"):  # parameters forward never used: the driver saved them
        state.update(read_objects(str(source), [UNTRACED])[UNTRACED])
    for alias, name in manifest.get("ties", {}).items():  # a tied parameter under each name the model has
        state[alias] = state[name]
    if "state_dict" in manifest:  # exactly the model's keys: not the non-persistent buffers a segment kept
        state = {k: state[k] for k in manifest["state_dict"] if k in state}
    return state


def save_atomically(state: dict[str, torch.Tensor], out: Path) -> None:
    """``state`` written to ``out`` (``export``'s formats) through a temporary sibling and a rename: a failed write
    leaves ``out`` as it was (absent, or the previous export), never half a file."""
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(tmp))
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Checkpoints:
    """Where and how often ``fit`` checkpoints: every ``every`` steps (0: only at the end)
    into ``root``, keeping the newest ``keep``. ``asynchronous``: the periodic checkpoints are
    written while the next steps run (the steps wait only for the ranks to copy what they
    hold; one is written at a time; the last, at the end, is written before ``fit`` returns)."""

    def __init__(self, root: str | os.PathLike[str], every: int = 0, keep: int = 3, *,
                 asynchronous: bool = False) -> None:
        if every < 0:
            raise ValueError(f"checkpoint interval must be >= 0 steps, got {every}")
        if keep < 1:
            raise ValueError(f"must keep at least 1 checkpoint, got {keep}")
        self.root = Path(root)
        self.every = every
        self.keep = keep
        self.asynchronous = asynchronous

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def path(self, step: int) -> Path:
        return self.root / checkpoint_name(step)
