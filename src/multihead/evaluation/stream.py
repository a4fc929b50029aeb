"""Translating a stream of lines: UTF-8 checked per line, blank lines kept, chunked output.

``scripts/translate.py`` reads stdin or a file through :func:`read_lines` and prints what
:func:`translate_lines` yields, so 10,000 lines start printing after the first chunk
instead of after the last, and one output line stands for every input line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO

from tqdm import tqdm

from multihead.attention.checks import check_bool


def read_lines(stream: BinaryIO, name: str) -> Iterator[str]:
    """The lines of a byte stream as text, without their line ends.

    Raises:
        ValueError: a line is not UTF-8 (the message names ``name`` and the line number).
    """
    for number, raw in enumerate(stream, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            bad = raw[err.start : err.start + 4]
            raise ValueError(
                f"{name} line {number} is not UTF-8 (byte {err.start}: {bad!r}); "
                "expected UTF-8 text"
            ) from None
        yield text.rstrip("\r\n")


def translate_lines(
    lines: Iterable[str],
    translate_chunk: Callable[[list[str], list[int]], list[str]],
    *,
    chunk_size: int = 1000,
    progress: bool = True,
) -> Iterator[str]:
    """One translation per line, in order, a chunk at a time.

    Blank lines are not translated: each gives an empty output line, so the output stays
    aligned with the input. ``translate_chunk(texts, line_numbers)`` translates the
    non-blank lines of a chunk (``line_numbers`` are 1-based, for its error messages).
    A progress bar counts lines on stderr.

    Raises:
        ValueError: the input has no lines at all.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    check_bool("progress", progress)
    bar = tqdm(unit=" lines", file=sys.stderr, disable=not progress, mininterval=1.0)
    count = 0
    chunk: list[str] = []
    with bar:
        for count, line in enumerate(lines, start=1):
            chunk.append(line)
            if len(chunk) == chunk_size:
                yield from _translate_chunk(chunk, count - len(chunk) + 1, translate_chunk)
                bar.update(len(chunk))
                chunk = []
        if count == 0:
            raise ValueError("no input lines; give one sentence per line on stdin or in input=")
        yield from _translate_chunk(chunk, count - len(chunk) + 1, translate_chunk)
        bar.update(len(chunk))


def _translate_chunk(
    chunk: list[str], first: int, translate_chunk: Callable[[list[str], list[int]], list[str]]
) -> list[str]:
    filled = [i for i, line in enumerate(chunk) if line.strip()]
    texts = (
        translate_chunk([chunk[i] for i in filled], [first + i for i in filled]) if filled else []
    )
    translated = dict(zip(filled, texts, strict=True))
    return [translated.get(i, "") for i in range(len(chunk))]
