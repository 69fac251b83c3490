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
