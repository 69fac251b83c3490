"""Messages crossing process boundaries: JSON round trips through the one codec, and checks."""

from __future__ import annotations

import dataclasses
import json

import pytest

import workers.protocol as protocol
from workers.protocol import (
    GenerateRequest,
    KVHandle,
    KVLayout,
    PairTransfer,
    PrefillResult,
    TokenChunk,
    TokenLogprobs,
    TransferAddress,
    TransferRequest,
    TransferStats,
    decode,
    encode,
)
from workers.transfer import control

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
ADDRESS = TransferAddress("10.0.0.5", 41234, "prefill-0", "node-a", "cuda", 3, "GPU-1234", 41235, 2**61 + 7)
HANDLE = KVHandle("req-1", "prefill-0", ADDRESS, (4, 9, 2), 40, LAYOUT, 1_700_000_000.5)


MESSAGES = [
    LAYOUT,
    ADDRESS,
    HANDLE,
    TransferRequest("req-1", "decode-3", 17, (9, 2), LAYOUT, "gloo", 12345),
    PairTransfer(1, 0, 18, "gloo", 0, 2),
    TransferRequest(
        "req-1",
        "decode-3",
        18,
        (9, 2),
        LAYOUT,
        "gloo",
        12345,
        (PairTransfer(0, 0, 18, "gloo", 0, 1), PairTransfer(1, 0, 19, "nccl", 0, 1)),
    ),
    PrefillResult(
        "req-1",
        42,
        (1, 2, 3),
        HANDLE,
        16,
        None,
        -0.25,
        ((42, -0.25), (7, -1.5)),
        {"prefill_queue_s": 0.01, "prefill_s": 0.2},
    ),
    PrefillResult("req-2", 2, (5,), None, 0, "stop"),
    TransferStats("req-1", "prefill-0", "gloo", 17, 2, 16384, 0.01, True),
    TransferStats("req-1", "prefill-0", "gloo", 17, 2, 16384, 0.01, True, (8192, 8192)),
    GenerateRequest(
        "req-1",
        (1, 2, 3),
        {"max_tokens": 8, "temperature": 0.0, "stop": ["x"]},
        "salt",
        (bytes.fromhex("00ff" * 8), bytes(range(16))),  # block hashes: bytes, hex in JSON
        1_700_000_000.25,
    ),
    TokenLogprobs(5, -0.5, ((5, -0.5), (6, -2.0))),
    TokenChunk(
        "req-1", (5, 6), (TokenLogprobs(5, -0.5), TokenLogprobs(6, -0.25, ((6, -0.25),))), "stop", 16, {"decode_s": 0.5}
    ),
    control.LeaseCall("req-1", 10.0),
    control.MoveCall("cmpl-1", recompute=True),
    control.Hello("decode-3"),
    control.ControlReply(False, 2**61 + 7, "prefill-0", "no live lease", 0.0, {"num_held": 3, "pools": [1, 2]}),
]


def _message_classes(module) -> set[type]:
    return {
        obj
        for obj in vars(module).values()
        if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj.__module__ == module.__name__
    }


def test_every_message_class_is_covered():
    covered = {type(m) for m in MESSAGES}
    assert _message_classes(protocol) - covered == set()
    assert _message_classes(control) - {control.ControlHandlers} - covered == set()


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_survive_json(message):
    wire = encode(message)
    json.loads(wire)  # plain JSON, no pickle
    assert decode(type(message), wire) == message


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
    data = json.loads(encode(HANDLE))
    del data["layout"]
    with pytest.raises(ValueError, match=r"layout\s+Field required"):
        decode(KVHandle, json.dumps(data))
    data = json.loads(encode(MESSAGES[3]))
    data["transport"] = "carrier_pigeon"  # the dataclass's own check runs on decode too
    with pytest.raises(ValueError, match="transport 'carrier_pigeon'"):
        decode(TransferRequest, json.dumps(data))
    data["src_block_ids"] = ["nine"]
    with pytest.raises(ValueError, match="src_block_ids"):
        decode(TransferRequest, json.dumps(data))


def test_kv_cache_dtype_is_one_enum_with_its_storage():
    assert protocol.KV_CACHE_DTYPES == ("auto", "int8", "fp8")
    auto, int8, fp8 = (protocol.KVCacheDType(v) for v in protocol.KV_CACHE_DTYPES)
    assert (auto.storage("bfloat16"), int8.storage("bfloat16"), fp8.storage("float32")) == (
        "bfloat16",
        "int8",
        "float8_e4m3fn",
    )
    assert not auto.quantized and int8.quantized and fp8.quantized
    assert f"kv_cache_dtype={fp8}" == "kv_cache_dtype=fp8" and str(int8) == "int8" and int8 == "int8"
    for kind in (auto, int8, fp8):
        assert kind.storage("float32") in protocol.DTYPE_SIZES  # every storage is a KVLayout dtype


def test_the_edges_parse_the_kv_cache_dtype_once(tiny_llama):
    from deploy.args import PDServeArgs
    from workers.engine.config import EngineConfig

    args = PDServeArgs.model_validate({"model": tiny_llama, "kv_cache_dtype": "int8"})
    assert args.kv_cache_dtype is protocol.KVCacheDType.INT8
    assert args.model_dump(mode="json")["kv_cache_dtype"] == "int8"  # what Serve's config carries
    assert EngineConfig(model_dir=tiny_llama, kv_cache_dtype="fp8").kv_cache_dtype is protocol.KVCacheDType.FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PDServeArgs.model_validate({"model": tiny_llama, "kv_cache_dtype": "int4"})
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' must be one of \('auto', 'int8', 'fp8'\)"):
        EngineConfig(model_dir=tiny_llama, kv_cache_dtype="int4")
