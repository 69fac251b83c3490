"""Messages crossing process boundaries: JSON round trips and layout checks."""

from __future__ import annotations

import json

import pytest

from workers.protocol import (
    KVHandle,
    KVLayout,
    PrefillResult,
    TransferAddress,
    TransferRequest,
    TransferStats,
)

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
ADDRESS = TransferAddress("10.0.0.5", 41234, "prefill-0", "node-a", "cuda", 3, "GPU-1234")
HANDLE = KVHandle("req-1", "prefill-0", ADDRESS, (4, 9, 2), 40, ("00ff", "a1b2", "c3d4"), LAYOUT,
                  1_700_000_000.5)


def json_round_trip(message):
    return type(message).from_dict(json.loads(json.dumps(message.to_dict())))


@pytest.mark.parametrize("message", [
    LAYOUT,
    ADDRESS,
    HANDLE,
    TransferRequest("req-1", "decode-3", 17, (9, 2), LAYOUT, "gloo", 12345),
    PrefillResult("req-1", 42, (1, 2, 3), HANDLE, 16, None, -0.25),
    PrefillResult("req-2", 2, (5,), None, 0, "stop"),
    TransferStats("req-1", "prefill-0", "gloo", 17, 2, 16384, 0.01, True),
])
def test_messages_survive_json(message):
    assert json_round_trip(message) == message


def test_bytes_per_block_counts_all_layers_k_and_v():
    assert LAYOUT.bytes_per_block == 2 * 2 * 16 * 2 * 8 * 4
    assert KVLayout(32, 16, 8, 128, "bfloat16").bytes_per_block == 32 * 2 * 16 * 8 * 128 * 2


def test_layout_mismatch_names_every_differing_field():
    other = KVLayout(num_layers=2, block_size=32, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    with pytest.raises(ValueError) as info:
        LAYOUT.check_matches(other)
    message = str(info.value)
    assert "block_size 16 on decode but 32 on prefill" in message
    assert "dtype float32 on decode but bfloat16 on prefill" in message
    assert "num_layers" not in message
    LAYOUT.check_matches(KVLayout(2, 16, 2, 8, "float32"))


def test_bad_messages_are_rejected():
    with pytest.raises(ValueError, match="dtype 'int7'"):
        KVLayout(2, 16, 2, 8, "int7")
    with pytest.raises(ValueError, match="block_size must be positive"):
        KVLayout(2, 0, 2, 8, "float32")
    with pytest.raises(ValueError, match="transport 'carrier_pigeon'"):
        TransferRequest("r", "d", 1, (1,), LAYOUT, "carrier_pigeon", 0)
    data = HANDLE.to_dict()
    del data["layout"]
    with pytest.raises(ValueError, match=r"missing fields \['layout'\]"):
        KVHandle.from_dict(data)
