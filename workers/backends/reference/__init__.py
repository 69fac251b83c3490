"""The reference backend: plain torch ops and gather + SDPA attention, on any device.

It is the specification every other backend is checked against (``tests/unit/test_conformance.py``):
transformers' order of operations, ``F.linear`` on the checkpoint's weights, and attention that
gathers the blocks a step reads into a padded copy for ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from workers.backends.base import Backend


class ReferenceBackend(Backend):
    name = "reference"
    attention_kinds = ("sdpa",)

    def kv_blocks(self, bytes_per_block: int) -> int:
        if self.device.type == "cuda":
            from workers.backends.cuda.backend import cuda_kv_blocks

            return cuda_kv_blocks(self.device, self.config.gpu_memory_utilization, bytes_per_block)
        return super().kv_blocks(bytes_per_block)

    def describe(self) -> str:
        return f"reference backend on {self.device} (plain torch, gather + SDPA)"
