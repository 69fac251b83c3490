"""Pool-level compatibility: every worker of a model must hash and lay out blocks the same way.

The first worker to register writes ``pd:{m}:compat`` (atomically, SET NX); every later worker
compares its own values against it and is refused with ``IncompatibleWorkerError`` naming the
value that differs. A block hash only means the same KV if these values agree.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# What an operator changes to fix each mismatch.
_REMEDY = {
    "model_key": "start every worker with the same --model (and revision)",
    "block_size": "start every worker with the same --block-size",
    "kv_cache_dtype": "start every worker with the same --kv-cache-dtype",
    "kv_storage_dtype": "start every worker with the same --dtype (with --kv-cache-dtype auto the KV cache "
    "stores the model's dtype)",
    "hash_algorithm_version": "run the same pdserve version on every worker",
}


class IncompatibleWorkerError(RuntimeError):
    """This worker's block layout differs from the pool's; it must not join the index."""

    def __init__(self, field: str, worker_value: object, pool_value: object) -> None:
        self.field = field
        self.worker_value = worker_value
        self.pool_value = pool_value
        super().__init__(f"{field} {worker_value} on this worker but {pool_value} in the pool: {_REMEDY[field]}")


@dataclass(frozen=True)
class PoolCompat:
    model_key: str
    block_size: int
    kv_cache_dtype: str  # the option: auto, int8 or fp8
    hash_algorithm_version: int
    kv_storage_dtype: str = ""  # what the cache stores (float32, bfloat16, int8, float8_e4m3fn, ...)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> PoolCompat:
        return cls(**json.loads(raw))

    def check_joins(self, pool: PoolCompat) -> None:
        """Raise IncompatibleWorkerError for the first value where ``self`` differs from ``pool``."""
        for field in _REMEDY:
            mine, theirs = getattr(self, field), getattr(pool, field)
            if mine != theirs:
                raise IncompatibleWorkerError(field, mine, theirs)
