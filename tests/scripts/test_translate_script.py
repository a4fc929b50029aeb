"""scripts/translate.py: one translation per input line, blank lines kept, a progress bar on
stderr; a user error ends the process with one line.

The script's ``main`` runs in this process (stdin replaced); one case runs it as a process.
How the input is read (empty, not UTF-8) is tested in tests/evaluation/test_stream.py; here,
that the script names such a file in one line and leaves it as it was. A missing checkpoint
is tested in tests/checkpoints/test_io.py.
"""

from __future__ import annotations

import io
import sys

import pytest

from helpers.scripts import assert_one_error_line, fails_in_one_line, run_script, script_main


@pytest.fixture
def ckpt(smoke_run_dir) -> str:
    return f"ckpt={smoke_run_dir / 'checkpoints' / 'last.ckpt'}"


def translate(monkeypatch, capsys, stdin: str, *overrides: str) -> tuple[str, str]:
    """``main`` on ``stdin``; its stdout and stderr."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    capsys.readouterr()
    script_main("translate.py", "translate", *overrides)
    out = capsys.readouterr()
    return out.out, out.err


def test_translate_reads_stdin(ckpt, monkeypatch, capsys) -> None:
    out, _ = translate(
        monkeypatch, capsys, "A dog runs.\nTwo men are talking.\n", ckpt, "beam_size=2"
    )
    assert len(out.splitlines()) == 2


def test_translate_keeps_blank_lines_aligned(ckpt, monkeypatch, capsys) -> None:
    out, _ = translate(
        monkeypatch,
        capsys,
        "A dog runs.\n\nTwo men are talking.\n   \n",
        ckpt,
        "beam_size=1",
        "progress=false",
    )
    lines = out.split("\n")[:-1]
    assert len(lines) == 4 and lines[1] == "" and lines[3] == "" and lines[0] and lines[2]


def test_translate_streams_ten_thousand_lines_with_progress(ckpt, monkeypatch, capsys) -> None:
    out, err = translate(
        monkeypatch,
        capsys,
        "A dog runs.\n" * 10_000,
        ckpt,
        "beam_size=1",
        "max_len_a=0",
        "max_len_b=2",
    )
    assert len(out.splitlines()) == 10_000
    assert "10000 lines" in err  # tqdm's final count on stderr


def test_a_line_longer_than_the_model_reads_is_named(ckpt, tmp_path, capsys) -> None:
    path = tmp_path / "in.txt"
    content = b"A dog.\n" + b"word " * 3000 + b"\n"
    path.write_bytes(content)
    line = fails_in_one_line(
        script_main, capsys, "translate.py", "translate", ckpt, f"input={path}"
    )
    assert "line 2 has" in line, line
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "no input lines"), (b"A dog.\ncaf\xe9\n", "line 2 is not UTF-8")],
)
def test_bad_input_is_named_and_left_alone(ckpt, tmp_path, capsys, content, message) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(content)
    line = fails_in_one_line(
        script_main, capsys, "translate.py", "translate", ckpt, f"input={path}"
    )
    assert message in line, line
    assert path.read_bytes() == content


@pytest.mark.slow  # a process; other bad input in-process above
def test_an_error_is_one_line_in_a_process(ckpt, tmp_path) -> None:
    result = run_script("translate.py", ckpt, "input=/nonexistent.txt", f"hydra.run.dir={tmp_path}")
    line = assert_one_error_line(result, "input file not found")
    assert result.stderr.strip().splitlines()[-1] == line
