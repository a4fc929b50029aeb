"""Data fixtures: the real Multi30k (``multi30k_dir`` is in tests/conftest.py) and one tokenizer."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from multihead.data import Tokenizer, load_parallel_dataset


@pytest.fixture(scope="session")
def multi30k(multi30k_dir: Path) -> datasets.DatasetDict:
    return load_parallel_dataset(src_lang="en", tgt_lang="de", local_dir=multi30k_dir)


@pytest.fixture(scope="session")
def multi30k_tokenizer(multi30k: datasets.DatasetDict) -> Tokenizer:
    train = multi30k["train"]
    return Tokenizer.train([*train["src"], *train["tgt"]], vocab_size=8000)
