"""Where the command writes is checked before any work: a missing folder, a file where a
folder should be, a folder where a file should be, and a write that fails anyway are each
refused naming the option (exit code 2 from the command), never a traceback."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

import pytest

from piper_train.cli import main
from piper_train.cli.outputs import output_file, writable_folder, writing


def test_an_output_file_needs_an_existing_folder_and_is_not_one(tmp_path) -> None:
    assert output_file(str(tmp_path / "plan.json")) == tmp_path / "plan.json"
    with pytest.raises(argparse.ArgumentTypeError, match=r"missing does not exist"):
        output_file(str(tmp_path / "missing" / "plan.json"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match=r"afile is not a folder"):
        output_file(str(tmp_path / "afile" / "plan.json"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"is a folder; name a file in it"):
        output_file(str(tmp_path))


def test_a_folder_written_during_the_run_is_made_up_front_or_refused(tmp_path) -> None:
    writable_folder(tmp_path / "runs" / "ckpt", "--checkpoint-dir")
    assert (tmp_path / "runs" / "ckpt").is_dir() and not any((tmp_path / "runs" / "ckpt").iterdir())
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--checkpoint-dir .*afile/ckpt: cannot write there \(.*\)"):
        writable_folder(tmp_path / "afile" / "ckpt", "--checkpoint-dir")


def test_a_write_that_fails_names_the_option() -> None:
    with pytest.raises(ValueError, match=r"--out plan.json: cannot write it \(No space left on device\)"):
        with writing(Path("plan.json"), "--out"):
            raise OSError(errno.ENOSPC, "No space left on device")


def test_the_command_refuses_an_output_it_cannot_write_before_working(tmp_path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    for argv, said in [
        (["simulate", "--schedule", "1f1b", "--trace", str(tmp_path / "no" / "t.json")], "argument --trace: cannot write"),
        (["plan", "--synthetic", "--out", str(tmp_path)], "argument --out:"),
    ]:
        with pytest.raises(SystemExit) as exited:  # argparse's own exit, as for any bad option
            main(argv)
        assert exited.value.code == 2 and said in capsys.readouterr().err
    code = main(["train", "--model", "mlp", "--steps", "1", "--checkpoint-dir", str(tmp_path / "afile" / "c")])
    err = capsys.readouterr().err
    assert code == 2 and "--checkpoint-dir" in err and "cannot write there" in err and "Traceback" not in err
