import logging
import math

import pytest
import torch
import torch.nn.functional as F

from multihead.attention import DESIGNS
from multihead.model import beam_search, greedy_decode, max_output_lengths

from helpers import REPO_ROOT, HostReads
from helpers.designs import write_sigmoid
from helpers.models import BOS, EOS, PAD, VOCAB, decoding_model, random_src, tiny_model

LIMITS = dict(max_len_a=1.0, max_len_b=4)
BEAM = dict(length_penalty=1.0, **LIMITS)


def _max_len(row: torch.Tensor, max_len_a: float, max_len_b: float, max_positions: int) -> int:
    real = int(row.ne(PAD).sum())
    return min(math.floor(max_len_a * real + max_len_b), max_positions - 1)


def naive_greedy(model, src_row, max_len):
    """One sentence, no cache, no padding: rerun the full forward at every step."""
    src = src_row[src_row.ne(PAD)][None]  # (1, S_real)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_len:
            logits = model(src, torch.tensor([[BOS, *out]]))
            token = int(logits[0, -1].argmax())
            if token == EOS:
                break
            out.append(token)
    return out


def naive_beam(model, src_row, max_len, beam_size, length_penalty):
    """The documented fairseq rule, written out for one sentence without caches."""
    src = src_row[src_row.ne(PAD)][None]
    K = beam_size
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[float, list[int]]] = []
    with torch.no_grad():
        for step in range(max_len + 1):
            candidates = []
            for b, (tokens, score) in enumerate(beams):
                logits = model(src, torch.tensor([[BOS, *tokens]]))[0, -1]
                log_probs = F.log_softmax(logits.float(), dim=-1)
                for v, lp in enumerate(log_probs.tolist()):
                    if step == max_len and v != EOS:
                        continue
                    candidates.append((score + lp, b, v))
            candidates.sort(key=lambda c: -c[0])
            top = candidates[: 2 * K]
            for score, b, v in top[:K]:
                if v == EOS and len(finished) < K:
                    finished.append((score / (step + 1) ** length_penalty, beams[b][0]))
            if len(finished) >= K or step == max_len:
                break
            live = [c for c in top if c[2] != EOS][:K]
            beams = [(beams[b][0] + [v], score) for score, b, v in live]
    best = max(finished, key=lambda f: f[0])
    return best[1]


def test_max_output_lengths_formula():
    src = torch.tensor([[5, 6, 7, 8, 9], [5, 6, PAD, PAD, PAD], [5, PAD, PAD, PAD, PAD]])
    lengths = max_output_lengths(src, pad_id=PAD, max_len_a=1.5, max_len_b=2, max_positions=100)
    assert lengths.tolist() == [9, 5, 3]  # floor(1.5 * 5 + 2), floor(1.5 * 2 + 2), ...
    capped = max_output_lengths(src, pad_id=PAD, max_len_a=1.5, max_len_b=2, max_positions=6)
    assert capped.tolist() == [5, 5, 3]


def test_output_lengths_respect_the_limit():
    model = tiny_model()  # tied random model: rarely says eos, so most hit the limit
    src = random_src(6, 8, seed=3)
    limits = max_output_lengths(src, pad_id=PAD, max_positions=model.max_positions, **LIMITS)
    for decode, kwargs in ((greedy_decode, {}), (beam_search, {"beam_size": 5})):
        outputs = decode(
            model, src, bos_id=BOS, eos_id=EOS, **kwargs, **(BEAM if kwargs else LIMITS)
        )
        assert all(len(o) <= n for o, n in zip(outputs, limits.tolist(), strict=True))
        assert any(len(o) == n for o, n in zip(outputs, limits.tolist(), strict=True))
        assert all(EOS not in o for o in outputs)
    # max_positions caps the length: bos plus 7 tokens fill 8 positions.
    short = tiny_model(max_positions=8)
    outputs = greedy_decode(short, src, bos_id=BOS, eos_id=EOS, max_len_a=5.0, max_len_b=5)
    assert max(len(o) for o in outputs) <= 7
    zero = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_len_a=0.0, max_len_b=0)
    assert zero == [[]] * 6


@pytest.mark.parametrize(
    "seed, positional", [(1, "sinusoidal"), (2, "sinusoidal"), (1, "rope"), (1, "alibi")]
)
def test_greedy_matches_uncached_reference(seed, positional):
    model = decoding_model(seed, positional=positional)
    src = random_src(8, 9, seed=seed, min_len=2)
    outputs = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, **LIMITS)
    expected = [naive_greedy(model, row, _max_len(row, **LIMITS, max_positions=64)) for row in src]
    assert outputs == expected
    assert len({len(o) for o in outputs}) > 2  # the test covers varied stopping points


# Every head design the docs name, as the Transformer's attention config: the package's
# (docs/reuse.md's table), the example docs/examples/own_head_design.py, and sigmoid
# attention (tests/helpers/designs.py, which docs/reuse.md cites), whose n is the key length
# (it refuses the cache) or a number (it does not).
SIGMOID = "sigmoid_attention.Sigmoid"
DOCUMENTED_DESIGNS = {
    "moh": {"design": "moh", "design_options": {"top_k_heads": 2, "num_shared_heads": 1}},
    "talking_heads": {"design": "talking_heads", "backend": "math"},
    "group_mlp": {"design": "group_mlp"},
    "head_attention": {"design": "head_attention"},
    "diff": {"design": "diff"},
    "mla": {"design": "mla", "design_options": {"kv_latent_dim": 8}},
    "head_temperature": {
        "design": "own_head_design.HeadTemperature",
        "design_options": {"start": 0.5},
    },
    "sigmoid-length": {"design": SIGMOID, "backend": "math"},
    "sigmoid-4": {"design": SIGMOID, "backend": "math", "design_options": {"sigmoid_n": 4.0}},
}


@pytest.fixture
def outside_designs(tmp_path, monkeypatch):
    """The docs' example and sigmoid attention importable by path."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "docs" / "examples"))
    monkeypatch.syspath_prepend(str(write_sigmoid(tmp_path)))


def test_every_design_of_the_package_is_among_the_documented_ones():
    ours = {name for name, cls in DESIGNS.items() if cls.__module__.startswith("multihead.")}
    assert ours <= {config["design"] for config in DOCUMENTED_DESIGNS.values()}


@pytest.mark.parametrize("design", DOCUMENTED_DESIGNS)
def test_decoding_steps_are_the_full_pass_of_their_prefix(design, outside_designs):
    """Through the searches' caches (make_decoder_cache), each step's logits equal the
    uncached pass over the prefix so far. Sigmoid attention with n the key length was 0.38
    off: its cached steps saw fewer keys; it now refuses the cache and is decoded by its
    full prefix."""
    model = tiny_model(attention={"num_heads": 4, **DOCUMENTED_DESIGNS[design]})
    B, S, T = 3, 6, 5
    src = random_src(B, S, seed=3)
    tgt = torch.randint(3, VOCAB, (B, T))
    tgt[:, 0] = BOS
    with torch.no_grad():
        memory, pad = model.encode(src)
        caches = model.make_decoder_cache(B, T, S)
        steps = [model.decode(tgt[:, t : t + 1], memory, pad, caches) for t in range(T)]
        full = [model.decode(tgt[:, : t + 1], memory, pad)[:, -1:] for t in range(T)]
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(full, 1), atol=1e-5, rtol=1e-4)


def test_a_design_that_refuses_the_cache_decodes_as_the_uncached_reference(outside_designs, caplog):
    """Greedy and beam search of sigmoid attention (n the key length) give what rerunning
    the whole model at each step gives, and the model says once that it decodes so. (No
    padding: its n counts the padded keys too, so a padded sentence is another input.)"""
    model = decoding_model(1, attention={"num_heads": 4, **DOCUMENTED_DESIGNS["sigmoid-length"]})
    src = random_src(6, 8, seed=7, min_len=8)
    limits = [_max_len(row, **LIMITS, max_positions=64) for row in src]
    with caplog.at_level(logging.INFO, logger="multihead.model.transformer"):
        greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, **LIMITS)
        beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, **BEAM)
    assert greedy == [naive_greedy(model, row, n) for row, n in zip(src, limits, strict=True)]
    assert beam == [naive_beam(model, row, n, 3, 1.0) for row, n in zip(src, limits, strict=True)]
    said = [r for r in caplog.records if "recomputes the full prefix" in r.getMessage()]
    assert len(said) == 1 and "'sigmoid'" in said[0].getMessage()


@pytest.mark.parametrize("norm_first", [False, True])
def test_beam_size_one_is_greedy(norm_first):
    model = decoding_model(1)
    if norm_first:
        model = tiny_model(1, norm_first=True, share_embeddings=False, tie_output=False)
    src = random_src(8, 9, seed=5, min_len=2)
    greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, **LIMITS)
    beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=1, **BEAM)
    assert beam == greedy


@pytest.mark.parametrize(
    ("beam_size", "length_penalty", "positional"),
    [
        (3, 1.0, "sinusoidal"),
        (4, 0.0, "sinusoidal"),
        (2, 0.6, "sinusoidal"),
        (3, 1.0, "rope"),
        (3, 1.0, "alibi"),
    ],
)
def test_beam_matches_uncached_reference(beam_size, length_penalty, positional):
    model = decoding_model(2, positional=positional)
    src = random_src(6, 8, seed=7, min_len=2)
    outputs = beam_search(
        model,
        src,
        bos_id=BOS,
        eos_id=EOS,
        beam_size=beam_size,
        length_penalty=length_penalty,
        **LIMITS,
    )
    expected = [
        naive_beam(model, row, _max_len(row, **LIMITS, max_positions=64), beam_size, length_penalty)
        for row in src
    ]
    assert outputs == expected


@pytest.mark.parametrize("variant", [None, 1])
def test_decoding_does_not_depend_on_batch_size(variant):
    model = decoding_model(1)
    if variant is not None:
        model = tiny_model(
            1,
            share_embeddings=False,
            tie_output=False,
            decoder_self_attention={"num_kv_heads": variant},
        )
    src = random_src(8, 10, seed=11, min_len=2)  # mixed lengths, one unpadded row
    searches = ((beam_search, {"beam_size": 5, "length_penalty": 1.0}), (greedy_decode, {}))
    for decode, kwargs in searches:
        batched = decode(model, src, bos_id=BOS, eos_id=EOS, **kwargs, **LIMITS)
        alone = [
            decode(model, row[row.ne(PAD)][None], bos_id=BOS, eos_id=EOS, **kwargs, **LIMITS)[0]
            for row in src
        ]
        assert batched == alone


def test_decoding_leaves_model_state_alone():
    model = decoding_model(1)
    src = random_src(3, 5)
    greedy_decode(model, src, bos_id=BOS, eos_id=EOS, **LIMITS)
    beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=2, **BEAM)
    assert not model.training
    assert not torch.is_inference_mode_enabled()
    with pytest.raises(ValueError, match="beam_size must be >= 1, got 0"):
        beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=0, **BEAM)


def test_beam_wider_than_half_the_vocabulary_matches_reference():
    """With 2K > V the first step cannot run on one row per sentence; all K rows start."""
    model = decoding_model(3)
    src = random_src(2, 5, seed=13, min_len=2)
    limits = dict(max_len_a=0.0, max_len_b=3)
    outputs = beam_search(
        model, src, bos_id=BOS, eos_id=EOS, beam_size=25, length_penalty=1.0, **limits
    )
    expected = [naive_beam(model, row, 3, 25, 1.0) for row in src]
    assert outputs == expected


@pytest.mark.parametrize("width", [40_000, 64 * 11 + 5, 130])
def test_chunked_topk_equals_torch_topk(width):
    # Beam search ranks its (n, K*V) candidates through the best chunks; the full sort is the
    # reference. Rows with -inf (sentences forced to eos) and a partial last chunk included.
    from multihead.model.decoding import _topk_by_chunks

    torch.manual_seed(width)
    scores = torch.randn(4, width)
    scores[0, : width // 2] = float("-inf")
    scores[1] = float("-inf")
    scores[1, [3, width - 1]] = torch.tensor([-2.0, -1.0])
    values, index = _topk_by_chunks(scores, 10)
    expected, _ = scores.topk(10, dim=1)
    assert torch.equal(values, expected)
    assert torch.equal(scores.gather(1, index), values)
    assert index[1, :2].tolist() == [width - 1, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["sdpa", "flash", "efficient", "cudnn", "flex", "flash_attn"])
def test_cuda_decoding_with_every_backend(backend):
    """Greedy and beam search run on CUDA with each backend (flash only where it may: the
    decoder self-attention; the padded encoder and cross-attention use efficient)."""
    from multihead.attention.backends import unavailable_reason

    reason = unavailable_reason(backend, torch.device("cuda"), torch.float16, head_dim=16)
    if reason is not None:
        pytest.skip(f"backend {backend!r} is absent here: {reason}")
    padded = "efficient" if backend == "flash" else backend
    kwargs = dict(share_embeddings=False, tie_output=False, d_model=64)
    ref = tiny_model(1, **kwargs, attention={"num_heads": 4, "backend": "math"}).cuda().half()
    model = tiny_model(
        1, **kwargs, attention={"num_heads": 4, "backend": padded},
        decoder_self_attention={"backend": backend},
    ).cuda().half()  # fmt: skip
    src = random_src(8, 10, seed=11, min_len=2).cuda()
    for decode, extra in ((greedy_decode, {}), (beam_search, {"beam_size": 5, **BEAM})):
        extra = extra if decode is beam_search else LIMITS
        with torch.no_grad():
            ours = decode(model, src, bos_id=BOS, eos_id=EOS, **extra)
            expected = decode(ref, src, bos_id=BOS, eos_id=EOS, **extra)
        same = sum(a == b for a, b in zip(ours, expected, strict=True))
        assert same >= 6, f"{backend}: {same}/8 sentences as the math backend's"


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_latent_attention_decodes_as_its_uncached_reference(absorb):
    """MLA in the decoder self- and cross-attention: the latent-only caches (absorbed or
    re-expanded at each step), beams reordering the latent, equal the uncached search."""
    model = tiny_model(
        1, share_embeddings=False, tie_output=False,
        decoder_self_attention={"design": "mla", "design_options": {"kv_latent_dim": 12}},
        cross_attention={"design": "mla", "design_options": {"kv_latent_dim": 6}},
    )  # fmt: skip
    with torch.no_grad():
        model.output_projection.weight.mul_(3.0)
    for layer in model.decoder_layers:
        layer.self_attn.design.absorb = layer.cross_attn.design.absorb = absorb
    assert model.kv_cache_bytes_per_token() == 2 * 12 * 4  # 2 layers, the latent alone
    assert model.cross_kv_cache_bytes_per_source_token() == 2 * 6 * 4
    src = random_src(6, 8, seed=7, min_len=2)
    limits = [_max_len(row, **LIMITS, max_positions=64) for row in src]
    greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, **LIMITS)
    assert greedy == [naive_greedy(model, row, n) for row, n in zip(src, limits, strict=True)]
    beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, **BEAM)
    expected = [naive_beam(model, row, n, 3, 1.0) for row, n in zip(src, limits, strict=True)]
    assert beam == expected


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_a_decoding_step_reads_the_device_once(search: str) -> None:
    """At most one host-device sync per step (issue 36, item 4), counted on the CPU."""
    model = decoding_model()
    src = random_src(5, 7, seed=3)
    starts, decode = [], model.decode

    def step(*args, **kwargs):
        starts.append(counter.count)
        return decode(*args, **kwargs)

    model.decode = step
    with HostReads() as counter:
        if search == "greedy":
            out = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, **LIMITS)
        else:
            out = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, **BEAM)
    ends = [*starts[1:], counter.count]
    per_step = [end - start for start, end in zip(starts, ends, strict=True)]
    assert len(out) == 5 and len(starts) >= 3
    assert max(per_step) <= 1, per_step
