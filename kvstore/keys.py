"""The index's key layout. Every key of one model shares the hash tag ``{model_key}``, so the
whole index of a model lives in one Redis Cluster slot and Lua scripts may touch any of it.

    pd:{m}:blk:<hex hash>    hash   worker id -> generation of each worker holding the block in
                                    any tier (device, host or disk)
    pd:{m}:worker:<id>       hash   the worker's record (WorkerRecord); expires unless heartbeated
    pd:{m}:wblocks:<id>      set    hex hashes worker <id> holds in any tier: exactly the blk
                                    entries of its current generation (writes are fenced on it);
                                    used to purge the worker and by lookups past the first block
    pd:{m}:wtier:<id>        hash   hex hash -> "1" (host) or "2" (disk): the best tier of those
                                    of worker <id>'s blocks that are not on device (absent:
                                    device). Its fields are a subset of wblocks:<id>, written by
                                    the same fenced apply and dropped with it (clear, register,
                                    deregister, purge), so it too is of the current generation
    pd:{m}:workers           hash   worker id -> generation of every registered worker, live or
                                    not yet purged: how lookups and purges enumerate workers
    pd:{m}:compat            string JSON PoolCompat, set by the first worker; refreshed by heartbeats
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hashing import BlockHash


@dataclass(frozen=True)
class IndexKeys:
    model_key: str

    @property
    def prefix(self) -> str:
        return f"pd:{{{self.model_key}}}:"

    @property
    def blk_prefix(self) -> str:
        return self.prefix + "blk:"

    @property
    def worker_prefix(self) -> str:
        return self.prefix + "worker:"

    @property
    def wblocks_prefix(self) -> str:
        return self.prefix + "wblocks:"

    @property
    def wtier_prefix(self) -> str:
        return self.prefix + "wtier:"

    @property
    def registry(self) -> str:
        return self.prefix + "workers"

    @property
    def compat(self) -> str:
        return self.prefix + "compat"

    def blk(self, block_hash: BlockHash) -> str:
        return self.blk_prefix + block_hash.hex()

    def worker(self, worker_id: str) -> str:
        return self.worker_prefix + worker_id

    def wblocks(self, worker_id: str) -> str:
        return self.wblocks_prefix + worker_id

    def wtier(self, worker_id: str) -> str:
        return self.wtier_prefix + worker_id
