"""Incremental detokenization never splits a multi-byte character."""

from transformers import AutoTokenizer

from workers.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Grüße aus Köln — naïve café", "東京タワーと富士山", "emoji: 🚀🔥👍🏽 done", "plain ascii text, 123"]


def test_streamed_pieces_are_whole_characters_and_add_up(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    split_somewhere = False
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        split_somewhere |= any("\ufffd" in tok.decode([i]) for i in ids)
        detok = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Say:"))
        pieces = [detok.add(i) for i in ids]
        pieces.append(detok.flush())
        assert all("\ufffd" not in p for p in pieces), pieces
        assert "".join(pieces) == detok.text == tok.decode(ids)
    assert split_somewhere, "the corpus should produce tokens that split a character"


def test_a_prompt_ending_inside_a_character_leaves_the_output_its_own_decoding(tiny_llama):
    """A random-token prompt that ends on a UTF-8 lead byte, answered by a continuation byte and a
    word (a test's prompt and the tiny model's greedy answer): the text is the output ids'
    decoding, replacement character included, not the prompt's character completed and lost."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt, output = [434, 740, 31, 408, 933, 157], [230, 563]
    assert tok.decode(prompt).endswith("\ufffd") and tok.decode(output) == "\ufffdable"
    assert not tok.decode(prompt + output).endswith("\ufffdable")  # in context the bytes join
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    pieces = [detok.add(i) for i in output] + [detok.flush()]
    assert pieces == ["", "\ufffdable", ""] and detok.text == tok.decode(output)
    leading = IncrementalDetokenizer(tok, prompt_token_ids=prompt)  # only its first byte: flushed
    assert (leading.add(230), leading.flush()) == ("", tok.decode([230]))
