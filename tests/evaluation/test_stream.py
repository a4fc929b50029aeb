"""Streaming translation input: UTF-8 per line, blank lines aligned, chunks in order."""

from __future__ import annotations

import io

import pytest

from multihead.evaluation.stream import read_lines, translate_lines


def upper(texts: list[str], numbers: list[int]) -> list[str]:
    return [f"{n}:{t.upper()}" for t, n in zip(texts, numbers, strict=True)]


def test_blank_lines_stay_blank_and_aligned() -> None:
    lines = ["a dog", "", "two men", "   ", "a cat"]
    out = list(translate_lines(lines, upper, chunk_size=2, progress=False))
    assert out == ["1:A DOG", "", "3:TWO MEN", "", "5:A CAT"]


def test_chunks_are_translated_as_they_come() -> None:
    seen: list[list[int]] = []

    def record(texts, numbers):
        seen.append(numbers)
        return texts

    stream = translate_lines((f"s{i}" for i in range(1, 8)), record, chunk_size=3, progress=False)
    assert next(stream) == "s1" and seen == [[1, 2, 3]]  # the first chunk, before the rest
    assert list(stream) == [f"s{i}" for i in range(2, 8)]
    assert seen == [[1, 2, 3], [4, 5, 6], [7]]


def test_empty_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="no input lines"):
        list(translate_lines([], upper, progress=False))


def test_progress_takes_a_bool_only() -> None:
    with pytest.raises(ValueError, match=r"^progress must be a bool, got 'no'$"):
        list(translate_lines(["ein Hund"], upper, progress="no"))


def test_invalid_utf8_names_the_line() -> None:
    data = io.BytesIO("ein Hund\nzwei Männer\n".encode() + b"caf\xe9\r\nok\n")
    lines = read_lines(data, "stdin")
    assert next(lines) == "ein Hund" and next(lines) == "zwei Männer"
    with pytest.raises(ValueError, match=r"stdin line 3 is not UTF-8 \(byte 3: b'\\xe9\\r\\n'\)"):
        next(lines)
