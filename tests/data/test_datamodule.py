from __future__ import annotations

import gzip
import itertools
import re
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from multihead.data import DataError, TokenBucketSampler, Tokenizer, TranslationDataModule


def make_dm(data_dir: Path, cache: Path, **kwargs) -> TranslationDataModule:
    settings = dict(
        local_dir=str(data_dir),
        vocab_size=1000,
        max_tokens=600,
        cache_dir=str(cache),
        train_limit=2000,
        val_limit=300,
        test_limit=200,
        seed=0,
    )
    settings.update(kwargs)
    return TranslationDataModule(**settings)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def dm(multi30k_dir: Path, cache_dir: Path) -> TranslationDataModule:
    dm = make_dm(multi30k_dir, cache_dir)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_setup_and_batches(dm: TranslationDataModule) -> None:
    assert {split: len(ds) for split, ds in dm.tokenized.items()} == {
        "train": 2000,
        "validation": 300,
        "test": 200,
    }
    assert dm.pad_id == 0 and dm.vocab_size == 1000
    seen = []
    for batch in dm.train_dataloader():
        b, s = batch["src"].shape
        assert batch["tgt"].shape[0] == b == len(batch["src_text"]) == len(batch["tgt_text"])
        assert b * max(s, batch["tgt"].shape[1]) <= 600
        assert (batch["tgt"][:, 0] == dm.tokenizer.bos_id).all()
        assert 0 < batch["real_token_fraction"] <= 1
        seen += batch["src_text"]
    assert sorted(seen) == sorted(dm.tokenized["train"]["src"])
    first = next(iter(dm.train_dataloader()))
    text = dm.tokenizer.decode(first["tgt"][0])
    assert text == first["tgt_text"][0]


def test_eval_batches_in_sampler_order(dm: TranslationDataModule) -> None:
    loader = dm.test_dataloader()
    order = [i for batch in loader.batch_sampler for i in batch]
    decoded, texts = [], []
    for batch in loader:
        decoded += [dm.tokenizer.decode(row) for row in batch["tgt"]]
        texts += batch["tgt_text"]
    references = dm.tokenized["test"]["tgt"]
    assert sorted(order) == list(range(200))
    assert decoded == texts == [references[i] for i in order]


def test_second_setup_uses_caches(
    dm: TranslationDataModule, multi30k_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("retrained instead of loading the cache")

    monkeypatch.setattr(Tokenizer, "train", fail)
    again = make_dm(multi30k_dir, cache_dir)
    again.setup("fit")
    assert again.tokenizer.fingerprint() == dm.tokenizer.fingerprint()
    assert again.tokenized["train"]["src_ids"][:5] == dm.tokenized["train"]["src_ids"][:5]


def test_save_tokenizer(dm: TranslationDataModule, tmp_path: Path) -> None:
    path = dm.save_tokenizer(tmp_path / "run")
    assert path == tmp_path / "run" / "tokenizer.json"
    assert Tokenizer.load(path).fingerprint() == dm.tokenizer.fingerprint()


def test_state_dict_resume(dm: TranslationDataModule, multi30k_dir: Path, cache_dir: Path) -> None:
    it = iter(dm.train_dataloader())
    for _ in range(4):
        next(it)
    state = dm.state_dict()
    rest = [b["src_text"] for b in it]

    resumed = make_dm(multi30k_dir, cache_dir)
    resumed.load_state_dict(state)  # before setup, as Lightning may do
    resumed.setup("fit")
    assert [b["src_text"] for b in resumed.train_dataloader()] == rest


def test_train_sampler_takes_rank_and_world_size_from_the_trainer(
    multi30k_dir: Path, cache_dir: Path
) -> None:
    ranked = make_dm(multi30k_dir, cache_dir, max_tokens=300, seed=4)
    ranked.trainer = SimpleNamespace(world_size=2, global_rank=1)
    ranked.setup("fit")
    sampler = ranked.train_sampler
    assert (sampler.world_size, sampler.rank, sampler.max_tokens, sampler.seed) == (2, 1, 300, 4)
    reference = TokenBucketSampler(
        ranked.tokenized["train"]["length"], max_tokens=300, seed=4, world_size=2, rank=1
    )
    assert sampler.epoch_batches(0) == reference.epoch_batches(0)


def test_lowercase_tokenizes_lowercased_text(
    dm: TranslationDataModule, multi30k_dir: Path, cache_dir: Path
) -> None:
    cached = set((cache_dir / "tokenized").iterdir())
    lower = make_dm(multi30k_dir, cache_dir, lowercase=True)  # the same data and cache as dm
    lower.setup("fit")
    assert lower.tokenizer.fingerprint() != dm.tokenizer.fingerprint()
    assert len(set((cache_dir / "tokenized").iterdir()) - cached) == 1  # not dm's cased ids
    train = lower.tokenized["train"]
    for side, lang in (("src", "en"), ("tgt", "de")):
        with gzip.open(multi30k_dir / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            raw = [line.strip() for line in itertools.islice(f, len(train))]
        lowered = [text.lower() for text in raw]
        assert lower.tokenizer.decode_batch(train[f"{side}_ids"]) == lowered
        assert train[f"{side}_ids"] != dm.tokenized["train"][f"{side}_ids"]
        # The text columns, which become the references BLEU is scored against, stay cased.
        assert train[side] == raw != lowered


@pytest.mark.parametrize(
    "argument, message",
    [
        ({"lowercase": "yes"}, "data.lowercase must be a bool, got 'yes'"),
        ({"max_tokens": "abc"}, "data.max_tokens must be a positive integer, got 'abc'"),
        ({"max_tokens": 0}, "data.max_tokens must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, argument, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TranslationDataModule(cache_dir=str(tmp_path), **argument)


def test_bpe_dropout_resegments_training_batches_only(
    dm: TranslationDataModule, multi30k_dir: Path, cache_dir: Path
) -> None:
    drop = make_dm(multi30k_dir, cache_dir, bpe_dropout=0.3)  # the same data and cache as dm
    drop.setup("fit")
    assert drop.tokenizer.fingerprint() == dm.tokenizer.fingerprint()  # saved without dropout
    train = dm.tokenized["train"]
    usual_ids = dict(zip(train["tgt"], train["tgt_ids"], strict=True))
    texts, longer, shorter, total = [], 0, 0, 0
    for batch in drop.train_dataloader():
        for text, row in zip(batch["tgt_text"], batch["tgt"].tolist(), strict=True):
            # The raw text, not the ids, is the reference: every segmentation decodes to it.
            assert dm.tokenizer.decode(row) == text
            n = sum(1 for i in row if i != dm.pad_id) - 2  # without <bos> and <eos>
            longer += n > len(usual_ids[text])
            shorter += n < len(usual_ids[text])
            total += n
        texts += batch["tgt_text"]
    assert sorted(texts) == sorted(dm.tokenized["train"]["tgt"])  # each pair once per epoch
    usual_total = sum(len(ids) for ids in dm.tokenized["train"]["tgt_ids"])
    # Greedy BPE is not length-optimal, so a skipped merge can, rarely, open a path with
    # fewer pieces (about 1 sentence in 10^4 at p=0.3 on Multi30k): no per-row bound.
    assert longer > len(texts) / 2 and shorter < len(texts) / 100
    assert total > 1.2 * usual_total
    # Evaluation keeps the usual segmentation: the same batches as without BPE-dropout.
    for ours, usual in zip(drop.val_dataloader(), dm.val_dataloader(), strict=True):
        assert torch.equal(ours["src"], usual["src"]) and torch.equal(ours["tgt"], usual["tgt"])


@pytest.mark.parametrize("value", [-0.1, 1.0, "0.1", True])
def test_bpe_dropout_must_be_a_probability(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match=r"^data.bpe_dropout must be in \[0, 1\), got "):
        TranslationDataModule(cache_dir=str(tmp_path), bpe_dropout=value)


def test_hub_error_without_local_dir(tmp_path: Path) -> None:
    dm = TranslationDataModule(cache_dir=str(tmp_path))
    with pytest.raises(DataError, match="data.local_dir="):
        dm.setup("fit")


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_failing_runs_leave_the_cache_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    words = ["a dog runs", "two men sit", "the red ball", "a girl jumps", "blue sky"]
    for stem, count in (("train", 60), ("val", 10), ("test_2016_flickr", 10)):
        for lang in ("en", "de"):
            lines = [f"{words[i % 5]} {lang} {i}" for i in range(count)]
            (data / f"{stem}.{lang}.gz").parent.mkdir(exist_ok=True)
            (data / f"{stem}.{lang}.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    settings = dict(vocab_size=300, train_limit=None, val_limit=None, test_limit=None)
    make_dm(data, cache, **settings).setup("fit")
    before = snapshot(cache)
    assert any(name.startswith("tokenized/") for name in before)

    # Bad input: the run stops with a DataError before it writes anything.
    good = (data / "train.de.gz").read_bytes()
    (data / "train.de.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match="train.de.gz: not a valid gzip file"):
        make_dm(data, cache, **settings).setup("fit")
    assert snapshot(cache) == before

    # New data whose tokenization fails half-way: old entries stay, no partial new entry.
    (data / "train.de.gz").write_bytes(gzip.compress(b"\n".join([b"neu"] * 60)))

    def crash(self, texts):
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "encode_batch", crash)
    with pytest.raises(KeyboardInterrupt):
        make_dm(data, cache, **settings).setup("fit")
    after = snapshot(cache)
    assert {name: after[name] for name in before} == before
    new = set(after) - set(before)
    assert len(new) == 1 and new.pop().startswith("tokenizers/bpe-300-")  # trained, then crashed


class _Recorder(L.LightningModule):
    """Records the source sentences of every training batch; learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[str]] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["src_text"])
        return self.weight.sum() * 0.0 + self.weight.square().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(root: Path, max_steps: int, callbacks: list | None = None) -> L.Trainer:
    return L.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        enable_checkpointing=callbacks is not None,
    )


@pytest.mark.parametrize("extra_steps", [5, 0], ids=["mid-epoch", "epoch-end"])
def test_lightning_resume_continues_exactly(
    multi30k_dir: Path, cache_dir: Path, tmp_path: Path, extra_steps: int
) -> None:
    small = dict(train_limit=300, val_limit=20, test_limit=20, max_tokens=400)
    full_dm = make_dm(multi30k_dir, cache_dir, **small)
    full = _Recorder()
    full_dm.setup("fit")
    per_epoch = len(full_dm.train_sampler)
    total = per_epoch + per_epoch // 2 + 3
    _trainer(tmp_path / "full", total).fit(full, datamodule=full_dm)
    assert len(full.seen) == total

    stop = per_epoch + extra_steps
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=stop, save_top_k=-1
    )
    first = _Recorder()
    _trainer(tmp_path / "a", stop, [checkpoint]).fit(
        first, datamodule=make_dm(multi30k_dir, cache_dir, **small)
    )
    ckpt = next((tmp_path / "ckpt").glob("*.ckpt"))
    second = _Recorder()
    with pytest.warns(match="dataloader is not resumable") if extra_steps else nullcontext():
        _trainer(tmp_path / "b", total).fit(
            second, datamodule=make_dm(multi30k_dir, cache_dir, **small), ckpt_path=ckpt
        )
    assert first.seen + second.seen == full.seen
