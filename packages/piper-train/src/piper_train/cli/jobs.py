"""Job files: ``piper train --config job.toml`` (or ``.yaml``/``.yml``; ``piper check`` too),
and ``--print-config``, the effective options written as a job file (docs/jobs.md).

The schema of a job file is the subcommand's own argparse parser (``options``), not a second
definition: a key is an option's ``dest`` (its long name in snake_case: ``batch_size``), and a
value is checked against the kinds ``options.FILE_FORMS`` gives the option's argparse type,
then read by that same ``type`` and checked against the same ``choices`` as on the command
line; ``check_args`` then checks the merged options as it checks any command line. The file's
values become the subparser's defaults and the command line is parsed again, so a flag given
there wins over the file (``apply``).

A file is read as data, never run: TOML by ``tomllib``, YAML by PyYAML's ``SafeLoader`` (a tag
that would build a Python object, ``!!python/object:...``, is refused). A path in a job file
is relative to the working directory, as on the command line. Every mistake is a
``JobError`` naming the file, the line and the key, which ``apply`` turns into the
subcommand's usage error (exit code 2; with ``--json``, the document's ``error``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tomli_w
import yaml

from piper_directives import Strategy
from piper_ir import PiperError
from piper_train import bounds
from piper_train.cli.document import emit
from piper_train.cli.options import MAXIMUMS, MINIMUMS, SUBCOMMANDS, file_form

FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}
#: The commands that take ``--config``: a key of another of them is ignored (with a note), so
#: one job file serves ``piper train`` and ``piper check``.
COMMANDS = ("train", "check")
#: Options that are the command line's own, with why a job file cannot hold them.
NOT_IN_FILES = {
    "config": "is the command line's: a job file names no other job file",
    "print_config": "is the command line's (piper COMMAND --config FILE --print-config)",
    "json": "decides what stdout holds, which is the caller's to say: pass --json on the command line",
}


class JobError(ValueError):
    """A job file that cannot be read as the options of its command; the message starts
    with ``file:line:`` where a line is known."""


class EmbeddedStrategy:
    """A strategy embedded in a job file (a ``[strategy]`` table: the directive program's JSON
    form, ``Strategy.from_json``'s), standing where ``--strategy``'s path does: ``StrategyRequest``
    and ``model_regions`` read it through ``read_text`` and ``suffix``, messages name it by
    ``source`` (``job.toml:12 [strategy]``)."""

    suffix = ".json"

    def __init__(self, program: dict[str, Any], source: str) -> None:
        self.program = program
        self.source = source

    def read_text(self, encoding: str = "utf-8") -> str:
        return json.dumps(self.program)

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        return f"EmbeddedStrategy({self.source})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmbeddedStrategy) and other.program == self.program

    def __hash__(self) -> int:
        return hash(json.dumps(self.program, sort_keys=True))


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A parser's options by ``dest`` (``--help`` and positionals left out)."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and a.dest != argparse.SUPPRESS and a.default != argparse.SUPPRESS}


def _command_options(command: str) -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    for add in SUBCOMMANDS[command][1]:
        add(parser)
    return options_of(parser)


# ---------------------------------------------------------------------------------------------
# reading


def read(path: Path) -> tuple[dict[Any, Any], dict[Any, int]]:
    """The file's top-level table, and the line (1-based) of each of its keys."""
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise JobError(f"{path}: a job file is .toml, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise JobError(f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise JobError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    data, lines = _read_toml(path, text) if kind == "toml" else _read_yaml(path, text)
    if not isinstance(data, dict):
        raise JobError(f"{path}: a job file is a table of options (key = value), got {_describe(data)}")
    return data, lines


def _read_toml(path: Path, text: str) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        message = str(err)
        at = re.search(r"\s*\(at line (\d+), column \d+\)$", message)
        if at is None:
            raise JobError(f"{path}: not valid TOML: {message}") from None
        raise JobError(f"{path}:{at[1]}: not valid TOML: {message[:at.start()]}") from None
    return data, _toml_lines(text)


_TOML_KEY = r"(\"(?:[^\"\\]|\\.)*\"|'[^']*'|[A-Za-z0-9_-]+)"
_TOML_HEADER = re.compile(rf"\s*\[\[?\s*{_TOML_KEY}\s*(?:\.\s*{_TOML_KEY}\s*)*\]\]?\s*(?:#.*)?$")
_TOML_ASSIGNMENT = re.compile(rf"\s*{_TOML_KEY}\s*[.=]")


def _toml_lines(text: str) -> dict[str, int]:
    """The line of each top-level key of a TOML document (``tomllib`` keeps no positions):
    a ``key = value`` before the first table header, or a header's first key."""
    lines: dict[str, int] = {}
    top = True
    for number, line in enumerate(text.splitlines(), 1):
        header = _TOML_HEADER.match(line)
        if header:
            top = False
            lines.setdefault(_unquote(header[1]), number)
        elif top and (assignment := _TOML_ASSIGNMENT.match(line)):
            lines.setdefault(_unquote(assignment[1]), number)
    return lines


def _unquote(key: str) -> str:
    if key[:1] == '"':
        return json.loads(key)
    return key[1:-1] if key[:1] == "'" else key


def _read_yaml(path: Path, text: str) -> tuple[Any, dict[Any, int]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = {} if node is None else loader.construct_document(node)
    except yaml.constructor.ConstructorError as err:  # a tag SafeLoader has no constructor for
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        tag = re.search(r"tag '([^']*)'", str(err.problem))
        raise JobError(f"{where}: the tag {tag[1] if tag else ''!r} is refused: a job file is data, read as YAML's "
                       "safe subset (no tag that builds a Python object)") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise JobError(f"{where}: not valid YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise JobError(f"{path}: not valid YAML: {err}") from None
    finally:
        loader.dispose()
    lines: dict[Any, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in lines:
                    raise JobError(f"{path}:{key.start_mark.line + 1}: duplicate key {key.value!r} (first at line "
                                   f"{lines[key.value]})")
                lines[key.value] = key.start_mark.line + 1
    return data, lines


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


# ---------------------------------------------------------------------------------------------
# the options of a file


def values(path: Path, command: str, note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The options ``path`` gives ``piper command``, by ``dest``, as argparse would have
    parsed them from the command line (``JobError`` for any mistake)."""
    data, lines = read(path)
    options = _command_options(command)
    others = {other: _command_options(other) for other in COMMANDS if other != command}
    out: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}:{lines[key]}" if key in lines else str(path)
        if not isinstance(key, str):
            raise JobError(f"{where}: {key!r} is not an option's name")
        if key in NOT_IN_FILES:
            raise JobError(f"{where}: {key!r} {NOT_IN_FILES[key]}")
        action = options.get(key)
        if action is None:
            owner = next((other for other, known in others.items() if key in known), None)
            if owner is None:
                raise JobError(f"{where}: unknown key {key!r}{_suggestion(key, options)}")
            if note is not None:
                note(f"piper {command}: {where}: {key!r} is an option of piper {owner}, not of piper {command}; "
                     "ignored")
            continue
        out[key] = _value(action, key, value, where)
    return out


def _suggestion(key: str, options: dict[str, argparse.Action]) -> str:
    snake = key.lstrip("-").replace("-", "_")
    if snake in options:
        return f" (did you mean {snake!r}? keys are the long options' names in snake_case)"
    close = difflib.get_close_matches(snake, [k for k in options if k not in NOT_IN_FILES], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _value(action: argparse.Action, key: str, value: object, where: str) -> Any:
    """``value`` read as ``action`` reads its flag's text (its ``type`` and ``choices``)."""
    if key == "strategy" and isinstance(value, dict):
        return embedded(value, f"{where} [strategy]")
    if action.nargs == 0:  # a flag (store_true)
        if not isinstance(value, bool):
            raise JobError(f"{where}: {key} must be true or false, got {_describe(value)}")
        return value
    form = file_form(action.type)
    if isinstance(value, bool) or not isinstance(value, form.kinds):
        kind = "a string (a file) or a table (the program)" if key == "strategy" else form.kind
        hint = ""
        if isinstance(value, str) and float in form.kinds and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", value):
            hint = f" (YAML 1.1 reads {value} as a string; write it with a point: {re.sub('[eE]', '.0e', value, count=1)})"
        raise JobError(f"{where}: {key} must be {kind}, got {_describe(value)}{hint}")
    try:
        parsed = value if action.type is None else action.type(str(value))
    except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
        raise JobError(f"{where}: {key}: {err}") from None
    if action.choices is not None and parsed not in action.choices:
        raise JobError(f"{where}: {key} must be one of {', '.join(map(str, action.choices))}; got {value!r}")
    if key in MINIMUMS and isinstance(parsed, int | float):  # check_args's bounds, said at the line
        minimum, strict = MINIMUMS[key]
        wrong = bounds.problem(parsed, minimum=minimum, strict=strict, maximum=MAXIMUMS.get(key))
        if wrong is not None:
            raise JobError(f"{where}: {key} {wrong}, got {value!r}")
    return parsed


def embedded(table: dict[str, Any], source: str) -> EmbeddedStrategy:
    """A ``[strategy]`` table, read now as ``Strategy.from_json`` reads a file (its mistakes
    are the file's: a ``JobError``)."""
    if unknown := sorted(map(str, set(table) - {"directives"})):
        raise JobError(f"{source}: unknown key {unknown[0]!r} (a strategy is a table of one key, directives: the "
                       "list of its directives)")
    try:
        text = json.dumps(table)
    except (TypeError, ValueError) as err:
        raise JobError(f"{source}: not JSON data ({err})") from None
    try:
        Strategy.from_json(text, source=source)
    except PiperError as err:
        raise JobError(str(err)) from None
    return EmbeddedStrategy(table, source)


def apply(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> argparse.Namespace:
    """``args`` parsed again with ``args.config``'s values as the subcommand's defaults: the
    flags of ``argv`` win. A bad file is the subcommand's usage error (exit code 2)."""
    command = args.subparser
    try:
        found = values(args.config, args.command, note=lambda text: print(text, file=sys.stderr))
    except JobError as err:
        command.error(str(err))
    command.set_defaults(**found)
    return parser.parse_args(argv)


def load(path: str | Path, command: str = "train", flags: Sequence[str] = ()) -> argparse.Namespace:
    """The options ``piper COMMAND --config PATH FLAGS`` runs with, checked as the command
    checks them (``JobError`` otherwise, with the command's message): what a program that
    builds its own ``Trainer`` takes from a job file (``training.trainer_options(args, steps)``
    gives the ``OptimizerSpec``, ``RunOptions``, ``LRSchedule``, ... the command hands it;
    ``StrategyRequest.from_args(args).for_trainer()`` its strategy)."""
    from piper_train.cli.options import build_parser, check_args

    argv = [command, "--config", str(path), *flags]
    parser = build_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = apply(parser, parser.parse_args(argv), argv)
            check_args(parser, args)
    except SystemExit:
        errors = [line for line in said.getvalue().splitlines() if ": error: " in line]
        raise JobError(errors[-1].split(": error: ", 1)[1] if errors else said.getvalue().strip()) from None
    for line in said.getvalue().splitlines():  # the notes of keys another command takes
        print(line, file=sys.stderr)
    return args


# ---------------------------------------------------------------------------------------------
# --print-config


def effective(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options as a job file holds them: every option with a value (one left
    unset, ``None``, is decided at run time and left out), in ``--help``'s order."""
    out: dict[str, Any] = {}
    for key, action in options_of(args.subparser).items():
        value = getattr(args, key, None)
        if key in NOT_IN_FILES or value is None:
            continue
        if isinstance(value, EmbeddedStrategy):
            out[key] = value.program
        elif action.nargs == 0:
            out[key] = bool(value)
        else:
            out[key] = file_form(action.type).write(value)
    return out


def dumps(config: dict[str, Any], kind: str, command: str) -> str:
    """``config`` as a TOML or YAML job file."""
    head = f"# piper {command} --config FILE: the effective options, as --print-config {kind} wrote them\n"
    if kind == "yaml":
        return head + yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False)
    try:
        return head + tomli_w.dumps(config)
    except TypeError as err:  # a null in an embedded strategy read from YAML
        raise ValueError(f"--print-config toml: TOML cannot hold this configuration ({err}); use --print-config "
                         "yaml") from None


def print_config_command(args: argparse.Namespace) -> int:
    """``--print-config``: the effective options on stdout (with ``--json``: as the
    document's ``config``); nothing runs."""
    config = effective(args)
    text = dumps(config, args.print_config, args.command)  # refused before anything is written
    if args.json:
        emit(args, {"command": args.command, "config": config})
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0
