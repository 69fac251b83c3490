import hashlib

import pytest

from kvstore.hashing import ROOT_PARENT_HASH, hash_block, hash_prompt_blocks


def test_hash_matches_the_documented_formula():
    tokens = list(range(16))
    expected = hashlib.sha256(
        ROOT_PARENT_HASH
        + (5).to_bytes(4, "little")
        + b"model"
        + (0).to_bytes(4, "little")
        + b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)
    ).digest()[:16]
    assert hash_block(ROOT_PARENT_HASH, tokens, "model") == expected
    assert hash_prompt_blocks(tokens, 16, "model") == [expected]


def test_chain_covers_full_blocks_only_and_extends_incrementally():
    tokens = list(range(50))
    full = hash_prompt_blocks(tokens, 16, "m")
    assert len(full) == 3
    assert full[1] == hash_block(full[0], tokens[16:32], "m")
    assert hash_prompt_blocks(tokens, 16, "m", parent_hash=full[0], start_block=1) == full[1:]


def test_salt_and_model_key_separate_chains():
    tokens = list(range(32))
    plain = hash_prompt_blocks(tokens, 16, "m")
    assert hash_prompt_blocks(tokens, 16, "m", cache_salt="tenant-a") != plain
    assert hash_prompt_blocks(tokens, 16, "m2") != plain
    # length prefixes: moving bytes between key and salt must change the hash
    assert hash_block(ROOT_PARENT_HASH, tokens[:16], "ab", "c") != hash_block(ROOT_PARENT_HASH, tokens[:16], "a", "bc")


def test_rejects_token_ids_outside_int32():
    with pytest.raises(OverflowError):
        hash_prompt_blocks([2**31] * 16, 16, "m")
