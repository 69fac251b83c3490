"""Typed views of what the index stores about a worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """Load a worker reports with each heartbeat (set via ``IndexPublisher.set_load``)."""

    free_blocks: int
    num_running: int = 0
    num_waiting: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt's prefix one worker holds: ``blocks`` leading blocks in any tier, of
    which ``host`` and ``disk`` have that tier as their best (they must be loaded before use)."""

    blocks: int
    host: int = 0
    disk: int = 0

    @property
    def device(self) -> int:
        return self.blocks - self.host - self.disk


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One live worker as stored in ``pd:{m}:worker:<id>``."""

    worker_id: str
    role: str
    address: str
    generation: str  # changes with every worker start; block entries of other generations are stale
    total_blocks: int
    free_blocks: int
    num_running: int
    num_waiting: int
    block_size: int
    kv_cache_dtype: str
    hash_algorithm_version: int
    started_at: float  # unix time of the worker start that made this generation

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    def to_fields(self) -> dict[str, str]:
        return {
            "role": self.role,
            "address": self.address,
            "generation": self.generation,
            "total_blocks": str(self.total_blocks),
            "free_blocks": str(self.free_blocks),
            "num_running": str(self.num_running),
            "num_waiting": str(self.num_waiting),
            "block_size": str(self.block_size),
            "kv_cache_dtype": self.kv_cache_dtype,
            "hash_algorithm_version": str(self.hash_algorithm_version),
            "started_at": repr(self.started_at),
        }

    @classmethod
    def from_fields(cls, worker_id: str, fields: dict[str, str]) -> WorkerRecord:
        return cls(
            worker_id=worker_id,
            role=fields["role"],
            address=fields["address"],
            generation=fields["generation"],
            total_blocks=int(fields["total_blocks"]),
            free_blocks=int(fields["free_blocks"]),
            num_running=int(fields["num_running"]),
            num_waiting=int(fields["num_waiting"]),
            block_size=int(fields["block_size"]),
            kv_cache_dtype=fields["kv_cache_dtype"],
            hash_algorithm_version=int(fields["hash_algorithm_version"]),
            started_at=float(fields["started_at"]),
        )
