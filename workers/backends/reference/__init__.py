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

    def describe(self) -> str:
        return f"reference backend on {self.device} (plain torch, gather + SDPA)"
