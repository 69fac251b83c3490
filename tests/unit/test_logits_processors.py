"""Sampling controls (``workers/engine/logits_processors.py``): the batched tensor passes give
exactly what a plain-Python transcription of each definition gives, row by row, and leave rows
without controls bit for bit alone."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.logits_processors import apply_logits_processors, bad_words_token_ids
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

NEG_INF = float("-inf")
EOS = 2


def f32(x: float) -> float:
    """``x`` rounded to float32. One +, -, * or / of two float32 values computed in double and
    then rounded is exactly the float32 operation, so the reference below rounds after each."""
    return struct.unpack("f", struct.pack("f", x))[0]


def reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each definition transcribed, one row and one token at a time, on a copy."""
    out = logits.clone()
    vocab = out.shape[1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.processes_logits:
            continue
        row = out[i].tolist()
        past = seq.generated_token_ids
        for word in p.bad_words_ids:
            prefix = list(word[:-1])
            completes = not prefix or (len(past) >= len(prefix) and past[len(past) - len(prefix) :] == prefix)
            if completes and 0 <= word[-1] < vocab:
                row[word[-1]] = NEG_INF
        if len(past) < p.min_tokens:
            for token in seq.eos_token_ids | set(p.stop_token_ids):
                if 0 <= token < vocab:
                    row[token] = NEG_INF
        for token, bias in dict(p.logit_bias).items():
            if 0 <= token < vocab:
                row[token] = f32(row[token] + f32(bias))
        if p.repetition_penalty != 1.0:
            penalty = f32(p.repetition_penalty)
            for token in set(seq.prompt_token_ids + seq.output_token_ids):
                if 0 <= token < vocab:
                    row[token] = f32(row[token] / penalty) if row[token] > 0 else f32(row[token] * penalty)
        if p.frequency_penalty or p.presence_penalty:
            frequency, presence = f32(p.frequency_penalty), f32(p.presence_penalty)
            for token in set(past):
                if 0 <= token < vocab:
                    count = past.count(token)
                    row[token] = f32(row[token] - f32(f32(frequency * count) + presence))
        out[i] = torch.tensor(row, dtype=torch.float32)
    return out


def make_seq(
    prompt: list[int], output: list[int] | None = None, eos: frozenset[int] = frozenset({EOS}), **params
) -> Sequence:
    params.setdefault("max_tokens", 64)
    return Sequence(
        "r", list(prompt), SamplingParams(**params), 0.0, eos_token_ids=eos, output_token_ids=list(output or [])
    )


def random_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Both signs, and some exact zeros (neither branch of the repetition penalty's test)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 4
    logits[torch.rand(n, vocab, generator=g) < 0.05] = 0.0
    return logits


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def check(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    want = reference(logits, seqs)
    got = apply_logits_processors(logits, seqs)
    assert got is logits  # in place
    assert torch.equal(got, want), (got - want).abs().nan_to_num().max()
    return got


# --- each control alone, with values worked out by hand -------------------------------------


def test_bad_words_single_and_multi_token():
    vocab = 60
    words = ((7,), (10, 11, 12), (20, 21, 22), (30, 31, 32))
    # Ends with 10, 11: (10, 11, 12) completes. 20, 21 are not the last two: no ban.
    seqs = [make_seq([1, 2, 3], [20, 21, 5, 10, 11], bad_words_ids=words), make_seq([30], [31], bad_words_ids=words)]
    logits = random_logits(2, vocab, 0)
    before = logits.clone()
    out = check(logits, seqs)
    assert out[0, 7] == NEG_INF and out[0, 12] == NEG_INF
    assert out[0, 22] == before[0, 22] and out[0, 32] == before[0, 32]
    # (30, 31) must be the output's tail: the prompt's 30 is not generated, so 32 stays allowed.
    assert out[1, 7] == NEG_INF and out[1, 32] == before[1, 32]
    changed = (out != before).nonzero().tolist()
    assert sorted(changed) == [[0, 7], [0, 12], [1, 7]]


def test_bad_word_completed_across_a_resumed_stream():
    # The stream's first two tokens (10, 11) end the prompt: they are generated tokens too.
    seq = make_seq([1, 10, 11], [], output_position_offset=2, bad_words_ids=((10, 11, 12),))
    out = check(random_logits(1, 50, 1), [seq])
    assert out[0, 12] == NEG_INF


@pytest.mark.parametrize("generated, masked", [(0, True), (2, True), (3, False), (5, False)])
def test_min_tokens(generated: int, masked: bool):
    vocab = 50
    output = [9] * generated
    seqs = [
        make_seq([1, 2], output, min_tokens=3, stop_token_ids=[40, 41]),
        make_seq([1, 2], output, eos=frozenset(), ignore_eos=True, min_tokens=3, stop_token_ids=[40]),
    ]
    logits = random_logits(2, vocab, generated)
    before = logits.clone()
    out = check(logits, seqs)
    for row, tokens in ((0, [EOS, 40, 41]), (1, [40])):
        for t in tokens:
            assert (out[row, t] == NEG_INF) == masked
    assert out[1, EOS] == before[1, EOS]  # ignore_eos: EOS is an ordinary token
    if not masked:
        assert torch.equal(bits(out), bits(before))


def test_min_tokens_counts_a_resumed_streams_tokens():
    # Two of three generated before the migration + one here: the minimum is reached.
    seq = make_seq([5, 6, 7], [8], output_position_offset=2, min_tokens=3)
    logits = random_logits(1, 50, 2)
    before = logits.clone()
    check(logits, [seq])
    assert torch.equal(bits(logits), bits(before))


def test_logit_bias_several_entries():
    vocab = 50
    seq = make_seq([1], logit_bias={3: 5.0, 4: -100.0, 10: 0.25, 49: 100.0, 50: 1.0})
    logits = torch.zeros(1, vocab)
    out = check(logits, [seq])
    expected = torch.zeros(vocab)
    expected[[3, 4, 10, 49]] = torch.tensor([5.0, -100.0, 0.25, 100.0])
    assert torch.equal(out[0], expected)  # id 50 is outside the vocabulary: ignored


def test_logit_bias_repeated_token_keeps_last():
    seq = make_seq([1], logit_bias=((3, 1.0), (3, 2.0)))
    out = check(torch.zeros(1, 10), [seq])
    assert out[0, 3] == 2.0


def test_repetition_penalty_positive_and_negative():
    logits = torch.tensor([[2.0, -2.0, 0.0, 3.0, -3.0, 1.5]])
    seq = make_seq([0, 1], [2, 0], repetition_penalty=2.0)  # prompt and output, with a repeat
    out = check(logits, [seq])
    assert out[0].tolist() == [1.0, -4.0, 0.0, 3.0, -3.0, 1.5]
    reward = make_seq([0, 1], repetition_penalty=0.5)  # below 1 favours repeats
    assert check(torch.tensor([[2.0, -2.0, 1.0]]), [reward])[0].tolist() == [4.0, -1.0, 1.0]


def test_frequency_and_presence_count_generated_tokens_only():
    logits = torch.zeros(1, 10)
    # 4 is in the prompt only: not penalized. 5 generated three times, 6 once.
    seq = make_seq([4, 4, 5], [5, 6, 5, 5], frequency_penalty=0.5, presence_penalty=1.0)
    out = check(logits, [seq])
    assert out[0, 4] == 0.0
    assert out[0, 5] == -(0.5 * 3 + 1.0)
    assert out[0, 6] == -(0.5 + 1.0)


def test_frequency_counts_a_resumed_streams_tokens():
    # The prompt's last two tokens (7, 7) were generated on another replica.
    seq = make_seq([3, 7, 7], [7, 8], output_position_offset=2, frequency_penalty=1.0)
    out = check(torch.zeros(1, 10), [seq])
    assert out[0, 3] == 0.0 and out[0, 7] == -3.0 and out[0, 8] == -1.0


def test_order_ban_then_bias_then_penalties():
    # A banned token stays banned whatever the bias; the bias comes before the penalties.
    seq = make_seq(
        [1],
        [1, 2],
        bad_words_ids=((2,),),
        logit_bias={2: 100.0, 1: 4.0},
        repetition_penalty=2.0,
        frequency_penalty=1.0,
    )
    out = check(torch.tensor([[0.0, 2.0, 0.0]]), [seq])
    assert out[0, 2] == NEG_INF
    assert out[0, 1] == (2.0 + 4.0) / 2.0 - 1.0


# --- batches: controls mixed with plain rows ------------------------------------------------


def random_seq(rng: random.Random, vocab: int) -> Sequence:
    """A sequence with a random subset of the controls. Tokens are drawn from a small range half
    the time so that histories repeat tokens and bad words' prefixes match."""
    span = rng.choice([vocab, 12])
    prompt = [rng.randrange(span) for _ in range(rng.randint(1, 30))]
    output = [rng.randrange(span) for _ in range(rng.randint(0, 12))]
    offset = rng.randint(0, len(prompt) - 1) if rng.random() < 0.3 else 0
    ignore_eos = rng.random() < 0.3
    params: dict = {"ignore_eos": ignore_eos}
    if rng.random() < 0.4:
        params["min_tokens"] = rng.randint(1, 16)
        params["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.4:
        params["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        params["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        params["repetition_penalty"] = rng.choice([rng.uniform(0.5, 3), 1.3])
    if rng.random() < 0.4:
        params["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(1, 6))}
    if rng.random() < 0.4:
        generated = prompt[len(prompt) - offset :] + output if offset else output
        words = [(rng.randrange(vocab),) for _ in range(rng.randint(0, 2))]
        words += [tuple(rng.randrange(span) for _ in range(3)) for _ in range(rng.randint(0, 2))]
        if len(generated) >= 2:  # one that completes here
            words.append((*generated[-2:], rng.randrange(vocab)))
        params["bad_words_ids"] = words
    eos = frozenset() if ignore_eos else frozenset({EOS, vocab - 1})
    return make_seq(prompt, output, eos=eos, output_position_offset=offset, **params)


@pytest.mark.parametrize("seed", range(8))
def test_mixed_batch_matches_reference(seed: int):
    rng = random.Random(seed)
    vocab = rng.randint(50, 300)
    seqs = [random_seq(rng, vocab) for _ in range(rng.randint(4, 12))]
    seqs.append(make_seq([1, 2, 3], [4]))  # at least one plain row
    logits = random_logits(len(seqs), vocab, seed)
    before = logits.clone()
    check(logits, seqs)
    for i, seq in enumerate(seqs):
        if not seq.params.processes_logits:
            assert torch.equal(bits(logits[i]), bits(before[i]))


def test_rows_without_controls_untouched_bit_for_bit():
    vocab = 40
    logits = random_logits(4, vocab, 3)
    # Values a careless rewrite would change: NaN, -0.0, infinities.
    logits[1, :4] = torch.tensor([float("nan"), -0.0, float("inf"), NEG_INF])
    logits[3, :4] = torch.tensor([float("nan"), -0.0, float("inf"), NEG_INF])
    before = logits.clone()
    seqs = [
        make_seq([5, 6], [6, 7], repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={1: 1.0}),
        make_seq([5, 6], [6, 7], temperature=0.0, top_k=5),
        make_seq([5, 6], [], min_tokens=2, bad_words_ids=((9,),)),
        make_seq([5, 6], [6, 7]),
    ]
    apply_logits_processors(logits, seqs)
    assert torch.equal(bits(logits[[1, 3]]), bits(before[[1, 3]]))
    assert not torch.equal(logits[0], before[0]) and not torch.equal(logits[2], before[2])


def test_no_controls_returns_same_tensor_untouched():
    logits = random_logits(3, 64, 4)
    logits[0, 0] = float("nan")
    before = logits.clone()
    seqs = [make_seq([1, 2], [3]), make_seq([4], [], temperature=0.0), make_seq([5], [6, 6], ignore_eos=True)]
    out = apply_logits_processors(logits, seqs)
    assert out is logits
    assert torch.equal(bits(out), bits(before))
    assert apply_logits_processors(logits[:0], []) is not None  # an empty batch


def test_non_contiguous_logits_changed_in_place():
    # A view into a wider buffer (a padded vocabulary): the writes land in the buffer.
    vocab = 50
    buffer = random_logits(3, vocab + 14, 5)
    logits = buffer[:, :vocab]
    assert not logits.is_contiguous()
    seqs = [
        make_seq([1, 2], [2, 3], repetition_penalty=1.7, presence_penalty=0.3),
        make_seq([1], []),
        make_seq([4], [4, 4], frequency_penalty=0.7, logit_bias={0: 2.0}, bad_words_ids=((4, 9),)),
    ]
    want = reference(logits.clone(), seqs)
    tail = buffer[:, vocab:].clone()
    out = apply_logits_processors(logits, seqs)
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:, :vocab], want)
    assert torch.equal(bits(buffer[:, vocab:]), bits(tail))


def test_out_of_vocabulary_ids_ignored():
    # Ids the API would reject must not crash a batch that has them (or touch another logit).
    vocab = 20
    seq = make_seq(
        [1, 25],
        [3, 30],
        min_tokens=5,
        stop_token_ids=[99],
        bad_words_ids=((21,), (3, 30, 22)),
        repetition_penalty=2.0,
        frequency_penalty=1.0,
    )
    check(random_logits(1, vocab, 6), [seq])


# --- bad words from text ---------------------------------------------------------------------


class FakeTokenizer:
    """Each space-separated piece is one token; a piece that follows a space (or starts the text
    with one) is a different token from the same piece at the text's start, as with BPE."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        pieces = [("Ġ" if i or text.startswith(" ") else "") + w for i, w in enumerate(text.split())]
        return [self.vocab.setdefault(p, len(self.vocab) + 100) for p in pieces]


def test_bad_words_token_ids_both_variants_deduplicated():
    tok = FakeTokenizer()
    got = bad_words_token_ids(tok, ["hello", "big cat", " hello", "hello", "", "   "])
    hello, g_hello = tok.vocab["hello"], tok.vocab["Ġhello"]
    big, g_big, g_cat = tok.vocab["big"], tok.vocab["Ġbig"], tok.vocab["Ġcat"]
    # Start-of-text and after-a-space forms; " hello" as given is the spaced form again; the
    # empty and blank words encode to nothing.
    assert got == ((hello,), (g_hello,), (big, g_cat), (g_big, g_cat))
    assert all(special is False for _, special in tok.calls)
    assert bad_words_token_ids(tok, []) == ()


def test_bad_words_token_ids_feed_the_ban():
    tok = FakeTokenizer()
    words = bad_words_token_ids(tok, ["big cat"])
    big, g_big, g_cat = tok.vocab["big"], tok.vocab["Ġbig"], tok.vocab["Ġcat"]
    vocab = 120
    seqs = [
        make_seq([1], [5, g_big], bad_words_ids=words),
        make_seq([1], [big], bad_words_ids=words),
        make_seq([1], [5], bad_words_ids=words),
    ]
    out = check(random_logits(3, vocab, 7), seqs)
    assert out[0, g_cat] == NEG_INF and out[1, g_cat] == NEG_INF
    assert out[2, g_cat] != NEG_INF


# --- property: any parameters ------------------------------------------------------------------

penalties = st.floats(-2, 2)


@st.composite
def batches(draw) -> tuple[int, list[Sequence]]:
    vocab = draw(st.integers(50, 300))
    span = draw(st.sampled_from([vocab, 8]))  # small: repeats and bad-word matches are common
    tokens = st.integers(0, span - 1)
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(tokens, min_size=1, max_size=20))
        output = draw(st.lists(tokens, max_size=10))
        offset = draw(st.integers(0, len(prompt) - 1))
        ignore_eos = draw(st.booleans())
        words = draw(st.lists(st.lists(tokens, min_size=1, max_size=3).map(tuple), max_size=4))
        params = {
            "ignore_eos": ignore_eos,
            "output_position_offset": offset,
            "min_tokens": draw(st.sampled_from([0, 0, draw(st.integers(0, 15))])),
            "stop_token_ids": draw(st.lists(st.integers(0, vocab - 1), max_size=3)),
            "frequency_penalty": draw(st.sampled_from([0.0, draw(penalties)])),
            "presence_penalty": draw(st.sampled_from([0.0, draw(penalties)])),
            "repetition_penalty": draw(st.sampled_from([1.0, draw(st.floats(0.1, 5))])),
            "logit_bias": draw(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=5)),
            "bad_words_ids": words,
        }
        eos = frozenset() if ignore_eos else frozenset({EOS})
        seqs.append(make_seq(prompt, output, eos=eos, **params))
    return vocab, seqs


@settings(max_examples=150, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**31 - 1))
def test_batched_equals_reference(batch: tuple[int, list[Sequence]], seed: int):
    vocab, seqs = batch
    logits = random_logits(len(seqs), vocab, seed)
    before = logits.clone()
    check(logits, seqs)
    for i, seq in enumerate(seqs):
        if not seq.params.processes_logits:
            assert torch.equal(bits(logits[i]), bits(before[i]))
    assert not logits.isnan().any()
