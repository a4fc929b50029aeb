"""Batched greedy and beam-search decoding with the decoder's KV caches.

Both decoders encode the source once, then feed one new target token per step: the
self-attention caches grow by one position, the cross-attention caches hold the memory's
K/V projected on the first step (one row per sentence, shared by its beams), and the output
projection runs on the new position only.
A sentence that is finished leaves the running batch (its cache rows are dropped with
:meth:`DecoderCache.select`), so late steps only pay for the sentences still decoding. A
model whose decoder self-attention design refuses the cache gives a
:class:`~multihead.model.transformer.FullPrefix` instead, and each step runs the whole
prefix (``Transformer.make_decoder_cache`` says so once in the log).

Every step works on whole-batch tensors; each sentence's choices depend on its own rows only,
so a sentence decodes to the same tokens alone or in a padded batch (batch shapes change
floating-point rounding only, which could at most flip a near-exact tie).

Length limit, as fairseq: sentence ``i`` may generate at most
``max_len_i = min(floor(max_len_a * src_len_i + max_len_b), max_positions - 1)`` tokens
before eos, where ``src_len_i`` counts its non-pad source tokens; a hypothesis still
running at that length is ended with eos (its score includes eos's log-probability).

The caller puts the model in eval mode (``model.eval()``); decoding runs under
``torch.inference_mode()``.

On a GPU a step waits for the device once, to learn which sentences go on; everything else
a step decides is computed on the device (``tests/fake_cuda`` counts the waits). Before the
first step the length limits are read back once, and the tokens at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.model.transformer import Transformer


def max_output_lengths(
    src: Tensor, *, pad_id: int, max_len_a: float, max_len_b: float, max_positions: int
) -> Tensor:
    """``(B,)`` most tokens each sentence may generate before eos (see the module doc).

    ``max_positions - 1`` is the cap because the decoder is fed bos plus those tokens.
    """
    src_len = src.ne(pad_id).sum(dim=1)  # (B,)
    limit = torch.floor(src_len.double() * max_len_a + max_len_b).long()
    return limit.clamp(min=0, max=max_positions - 1)


def _to_lists(tokens: Tensor, eos_id: int) -> list[list[int]]:
    """Rows of ``(B, L)`` ids, each cut at its first eos (rows are eos-filled past the end)."""
    return [row[: row.index(eos_id)] if eos_id in row else row for row in tokens.tolist()]


def _topk_by_chunks(scores: Tensor, k: int, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """``scores.topk(k, dim=1)`` for rows much wider than ``k``, reading each row once.

    ``topk`` over a whole ``(n, K*V)`` row copies and partially sorts all of it; here only the
    ``k`` chunks of ``chunk`` columns with the largest maxima (plus the columns past the last
    whole chunk) are ranked. Exact: an element of the top ``k`` lies in one of those chunks,
    since otherwise ``k`` chunks would each hold a larger element. (Among equal values, e.g.
    the ``-inf`` of a sentence forced to eos, which index is returned may differ, as ``topk``
    leaves it unspecified too.)
    """
    n, width = scores.shape
    num_chunks = width // chunk
    if num_chunks <= k:
        return scores.topk(k, dim=1)
    whole = scores[:, : num_chunks * chunk].view(n, num_chunks, chunk)
    best_chunks = whole.amax(dim=2).topk(k, dim=1).indices  # (n, k)
    columns = torch.arange(chunk, device=scores.device)
    index = (best_chunks[:, :, None] * chunk + columns).view(n, k * chunk)  # (n, k*chunk)
    tail = torch.arange(num_chunks * chunk, width, device=scores.device).expand(n, -1)
    index = torch.cat([index, tail], dim=1)  # (n, k*chunk + width % chunk)
    values, position = scores.gather(1, index).topk(k, dim=1)  # (n, k), best first
    return values, index.gather(1, position)


def _start(
    model: Transformer, src: Tensor, max_len_a: float, max_len_b: float
) -> tuple[Tensor, list[int], Tensor, Tensor]:
    """What both searches begin with: the length limits on the device and on the host (one
    read), and the encoded source."""
    max_lens = max_output_lengths(
        src,
        pad_id=model.pad_id,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        max_positions=model.max_positions,
    )
    memory, src_pad_mask = model.encode(src)  # (B, S, E), (B, S)
    return max_lens, max_lens.tolist(), memory, src_pad_mask


def _still_running(done: Tensor) -> Tensor | None:
    """Indices of the rows of ``done`` ``(n,)`` that are False, or None if that is all of them.

    The step's one wait for the device: the number of rows left decides the next shapes.
    """
    keep = done.logical_not().nonzero().squeeze(1)  # (n',)
    return None if keep.numel() == done.numel() else keep


@torch.inference_mode()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    max_len_a: float,
    max_len_b: float,
) -> list[list[int]]:
    """Greedy decoding of a batch, one cached step per token; the arguments and result are
    those of :func:`beam_search`."""
    B, S = src.shape
    max_lens, limits, memory, src_pad_mask = _start(model, src, max_len_a, max_len_b)
    num_steps = max(limits) + 1  # the last step can only produce eos
    caches = model.make_decoder_cache(B, num_steps, S)

    output = src.new_full((B, num_steps), eos_id)  # eos past each sentence's end
    alive = torch.arange(B, device=src.device)  # sentence of each running row
    tokens = src.new_full((B, 1), bos_id)  # (n, 1), the token fed at this step
    for step in range(num_steps):
        logits = model.decode(tokens, memory, src_pad_mask, caches)  # (n, 1, V)
        next_tokens = logits[:, -1].argmax(dim=-1)  # (n,)
        # A sentence that already has max_len tokens is ended here.
        done = next_tokens.eq(eos_id) | max_lens.le(step)
        output[alive, step] = next_tokens.masked_fill(done, eos_id)
        keep = _still_running(done)
        if keep is not None:
            if keep.numel() == 0:
                break
            caches.select(keep, keep)
            memory, src_pad_mask = memory[keep], src_pad_mask[keep]
            alive, max_lens, next_tokens = alive[keep], max_lens[keep], next_tokens[keep]
        tokens = next_tokens[:, None]
    return _to_lists(output, eos_id)


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int,
    length_penalty: float,
    max_len_a: float,
    max_len_b: float,
) -> list[list[int]]:
    """Beam search over a batch, fairseq-style, returning each sentence's best hypothesis.

    Scores are sums of log-probabilities. At every step each sentence's ``K = beam_size``
    live beams propose their ``2K`` best extensions. Those ending in eos *and* ranked in the
    top ``K`` become finished hypotheses, scored (GNMT/fairseq length normalisation)::

        score = sum(log p(y_t)) / len ** length_penalty

    where ``len`` counts the generated tokens including eos (bos excluded). The best ``K``
    extensions not ending in eos are the next live beams (with ``2K`` candidates there
    always are ``K``). A sentence stops once it has ``K`` finished hypotheses (fairseq's
    rule: live beams are not checked against them, so with ``length_penalty > 0`` a longer
    hypothesis that might have scored higher is not explored) or when it reaches its length
    limit, where every live beam is ended with eos. Its result is the finished hypothesis with
    the best normalised score. With ``beam_size=1`` this is greedy decoding.

    Args:
        model: a :class:`Transformer`, already in eval mode.
        src: ``(B, S)`` source ids, right-padded with ``model.pad_id``.
        bos_id: the token that starts every target.
        eos_id: the token that ends one.
        beam_size: ``K``.
        length_penalty: the exponent above; 0 ranks by raw log-probability, larger values
            favour longer outputs.
        max_len_a, max_len_b: at most ``floor(a * src_len + b)`` tokens per sentence.

    Returns:
        ``B`` lists of token ids, without bos and eos.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    B, S = src.shape
    K = beam_size
    device = src.device
    max_lens, limits, memory, src_pad_mask = _start(model, src, max_len_a, max_len_b)
    num_steps = max(limits) + 1  # the last step can only produce eos
    first_forced_step = min(limits)  # before it, no sentence is at its length limit
    V = model.output_projection.out_features
    # At the first step every beam of a sentence would extend the same bos with the same
    # log-probabilities, and only beam 0 counts, so the first step runs on one row per
    # sentence (as CTranslate2 does); the rows become K after it. That needs 2K candidates
    # from one row, so with a vocabulary under 2K all K rows start at once instead.
    first_rows = 1 if 2 * K <= V else K
    # memory, src_pad_mask and the cross-attention caches keep one row per sentence, which
    # its beams share (see Transformer.decode).
    caches = model.make_decoder_cache(B * first_rows, num_steps, S, num_sentences=B)

    # Rows are sentence-major: row i * k + b is beam b of running sentence i, with k rows per
    # sentence (first_rows at the first step, K afterwards).
    scores = torch.full((B, first_rows), float("-inf"), device=device)  # (n, k) live log-probs
    scores[:, 0] = 0.0  # the other rows (only when first_rows == K) must not be picked
    history = src.new_full((B * first_rows, num_steps), eos_id)  # (n*k, steps) live beams
    num_finished = torch.zeros(B, dtype=torch.long, device=device)  # (n,)
    best_score = torch.full((B,), float("-inf"), device=device)  # per sentence, all B
    best_tokens = src.new_full((B, num_steps), eos_id)
    alive = torch.arange(B, device=device)  # sentence of each running group of rows
    tokens = src.new_full((B * first_rows, 1), bos_id)  # (n*k, 1)
    beam_offsets = torch.arange(K, device=device)
    not_eos = torch.arange(V, device=device).ne(eos_id)  # (V,)
    for step in range(num_steps):
        n, k = scores.shape
        logits = model.decode(tokens, memory, src_pad_mask, caches)[:, -1]  # (n*k, V)
        # Log-probabilities plus each beam's score, in place: the (n*k, V) buffers are the
        # largest of the search and allocating them again per step costs as much as the sum.
        candidates = F.log_softmax(logits.float(), dim=-1)  # (n*k, V)
        forced = max_lens.le(step)  # (n,) sentences at their length limit: eos only
        if step >= first_forced_step:  # known on the host: no wait for `forced`
            candidates.view(n, k, V).masked_fill_(forced[:, None, None] & not_eos, float("-inf"))
        candidates.add_(scores.view(-1, 1))
        candidates = candidates.view(n, k * V)
        top_scores, top_index = _topk_by_chunks(candidates, 2 * K)  # (n, 2K), best first
        top_beam = top_index // V  # (n, 2K) the row each candidate extends
        top_token = top_index % V
        top_eos = top_token.eq(eos_id)

        # Finish eos candidates ranked in the top K, up to K finished per sentence. Written
        # for every sentence (a no-op where none finishes), so that no step waits to learn
        # whether one did.
        new_finished = top_eos[:, :K] & top_scores[:, :K].isfinite()  # (n, K)
        free_slots = K - num_finished  # (n,)
        new_finished &= new_finished.cumsum(dim=1) <= free_slots[:, None]
        num_finished += new_finished.sum(dim=1)
        normalised = top_scores[:, :K] / (step + 1) ** length_penalty
        normalised = normalised.masked_fill(~new_finished, float("-inf"))
        step_best, position = normalised.max(dim=1)  # (n,)
        previous_best = best_score[alive]  # (n,)
        better = step_best > previous_best  # False where nothing finished (-inf)
        ended_beam = top_beam.gather(1, position[:, None]).squeeze(1)  # (n,)
        rows = torch.arange(n, device=device) * k + ended_beam  # its history row
        best_score[alive] = torch.where(better, step_best, previous_best)
        # Its history is eos from column `step` on, so the eos is already there.
        best_tokens[alive] = torch.where(better[:, None], history[rows], best_tokens[alive])

        # The next live beams: the best K candidates that do not end in eos.
        live_scores = top_scores.masked_fill(top_eos, float("-inf"))
        scores, pick = live_scores.topk(K, dim=1)  # (n, K)
        next_tokens = top_token.gather(1, pick)  # (n, K)
        origin = torch.arange(n, device=device)[:, None] * k + top_beam.gather(1, pick)
        origin = origin.view(-1)  # (n*K,) the row each new beam extends
        history = history[origin]
        history[:, step] = next_tokens.view(-1)

        done = num_finished.ge(K) | forced  # (n,)
        keep = _still_running(done)  # (n',) or None
        if keep is not None:
            if keep.numel() == 0:
                break
            keep_rows = (keep[:, None] * K + beam_offsets).view(-1)  # (n'*K,)
            origin, history = origin[keep_rows], history[keep_rows]
            scores, next_tokens = scores[keep], next_tokens[keep]
            alive, max_lens, num_finished = alive[keep], max_lens[keep], num_finished[keep]
            memory, src_pad_mask = memory[keep], src_pad_mask[keep]
        # Beams move every step, sentences leave only now and then: the memory's K/V are
        # copied only then.
        caches.select(origin, keep)
        tokens = next_tokens.view(-1, 1)
    return _to_lists(best_tokens, eos_id)


def decode(
    model: Transformer,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int,
    length_penalty: float,
    max_len_a: float,
    max_len_b: float,
) -> list[list[int]]:
    """Greedy decoding for ``beam_size=1`` (what beam search gives then, faster), else beam
    search; the arguments are those of :func:`beam_search`."""
    limits = dict(bos_id=bos_id, eos_id=eos_id, max_len_a=max_len_a, max_len_b=max_len_b)
    if beam_size == 1:
        return greedy_decode(model, src, **limits)
    return beam_search(model, src, beam_size=beam_size, length_penalty=length_penalty, **limits)
