"""Index configs, key layout and the compatibility rule, without Redis."""

import pytest

from kvstore.compat import IncompatibleWorkerError, PoolCompat
from kvstore.config import IndexConfig, WorkerSpec
from kvstore.keys import IndexKeys
from kvstore.record import WorkerRecord


def test_key_layout_shares_one_cluster_hash_tag() -> None:
    keys = IndexKeys("Qwen/Qwen3-0.6B")
    assert keys.blk(bytes(range(16))) == "pd:{Qwen/Qwen3-0.6B}:blk:000102030405060708090a0b0c0d0e0f"
    assert keys.worker("p0") == "pd:{Qwen/Qwen3-0.6B}:worker:p0"
    assert keys.wblocks("p0") == "pd:{Qwen/Qwen3-0.6B}:wblocks:p0"
    assert keys.registry == "pd:{Qwen/Qwen3-0.6B}:workers"
    assert keys.compat == "pd:{Qwen/Qwen3-0.6B}:compat"


def test_config_rejects_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="ttl_s 1.0 must exceed heartbeat_interval_s 1.0"):
        IndexConfig(redis_url="redis://h:1/0", model_key="m", heartbeat_interval_s=1.0, ttl_s=1.0)
    with pytest.raises(ValueError, match="no braces"):
        IndexConfig(redis_url="redis://h:1/0", model_key="a{b}")
    with pytest.raises(ValueError, match="scheme 'http'"):
        IndexConfig(redis_url="http://h:1", model_key="m")
    with pytest.raises(ValueError, match="role 'router' is not one of prefill, decode, colocated"):
        WorkerSpec("w", "router", "a", total_blocks=8, block_size=16, kv_cache_dtype="bf16")


def test_password_is_redacted_in_messages() -> None:
    assert IndexConfig(redis_url="redis://:pw@h:6380/2", model_key="m").redis_url_redacted == ("redis://:***@h:6380/2")
    assert IndexConfig(redis_url="rediss://u:pw@h:6380/0", model_key="m").redis_url_redacted == (
        "rediss://u:***@h:6380/0"
    )
    assert IndexConfig(redis_url="redis://h:6380/0", model_key="m").redis_url_redacted == ("redis://h:6380/0")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "block_size",
            32,
            "block_size 32 on this worker but 16 in the pool: start every worker with the same --block-size",
        ),
        (
            "kv_cache_dtype",
            "fp8",
            "kv_cache_dtype fp8 on this worker but auto in the pool: start every worker with the same --kv-cache-dtype",
        ),
        (  # both auto, but the models run in different dtypes: the flag to change is --dtype
            "kv_storage_dtype",
            "float32",
            "kv_storage_dtype float32 on this worker but bfloat16 in the pool: start every worker with the same "
            "--dtype (with --kv-cache-dtype auto the KV cache stores the model's dtype)",
        ),
        (
            "hash_algorithm_version",
            2,
            "hash_algorithm_version 2 on this worker but 1 in the pool: run the same pdserve version on every worker",
        ),
    ],
)
def test_compat_names_the_differing_value(field: str, value: object, message: str) -> None:
    pool = PoolCompat(
        model_key="m", block_size=16, kv_cache_dtype="auto", hash_algorithm_version=1, kv_storage_dtype="bfloat16"
    )
    worker = PoolCompat(**{**pool.__dict__, field: value})
    with pytest.raises(IncompatibleWorkerError) as info:
        worker.check_joins(PoolCompat.from_json(pool.to_json()))
    assert str(info.value) == message
    assert (info.value.field, info.value.worker_value) == (field, value)
    pool.check_joins(pool)  # identical values join


def test_worker_record_round_trips_through_redis_fields() -> None:
    record = WorkerRecord("p0", "prefill", "10.0.0.1:9000", "00ff", 1000, 250, 3, 1, 16, "bfloat16", 1, 1700000000.25)
    assert WorkerRecord.from_fields("p0", record.to_fields()) == record
    assert record.kv_cache_usage == 0.75
