"""Compiles pdserve's hand-written Triton kernels for an H100/H200 (sm_90) without a GPU and prints
one JSON line per kernel: its shared memory and warps. Run as a script, without TRITON_INTERPRET
(under the interpreter ``triton.jit`` makes no compilable kernel): tests/unit/test_triton_compile.py."""

from __future__ import annotations

import inspect
import json
import os

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from workers.backends.cuda import triton_checksum, triton_paged, triton_prefill  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def signature(kernel, pointers: dict[str, str], ints: str = "i32") -> dict[str, str]:
    """Pointers as given (default the first entry's type), constexprs by their upper-case names,
    ``scale`` fp32, every other argument an int."""
    out = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name.endswith("_ptr"):
            out[name] = pointers.get(name, pointers["*"])
        elif name.isupper():
            out[name] = "constexpr"
        elif name == "scale":
            out[name] = "fp32"
        else:
            out[name] = ints
    return out


def compile_one(what: str, kernel, pointers: dict[str, str], constexprs: dict) -> None:
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature(kernel, pointers), constexprs=constexprs), target=TARGET
    )
    print(json.dumps({"kernel": what, "shared": compiled.metadata.shared, "warps": compiled.metadata.num_warps}))


def main() -> None:
    prefill = triton_prefill._kernel()
    for dtype, paged in (("bf16", True), ("fp16", False), ("fp32", True)):
        compile_one(
            f"prefill {dtype} {'paged' if paged else 'dense'}",
            prefill,
            {"*": f"*{dtype}", "table_ptr": "*i64"},
            {"GROUP": 4, "G_PAD": 4, "BLOCK_T": 16, "BLOCK_N": 64, "BLOCK_SIZE": 16, "HEAD_DIM": 128,
             "PAGED": paged, "IEEE": dtype == "fp32"},
        )  # fmt: skip
    split, combine = triton_paged._kernels()
    for dtype in ("bf16", "fp32"):
        compile_one(
            f"decode split {dtype}",
            split,
            {"*": f"*{dtype}", "tables_ptr": "*i64", "first_pos_ptr": "*i64", "lens_ptr": "*i64",
             "acc_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32"},
            {"GROUP": 4, "BLOCK_SIZE": 16, "BLOCK_N": 64, "HEAD_DIM": 128, "G_PAD": 16, "IEEE": dtype == "fp32"},
        )  # fmt: skip
    compile_one(
        "decode combine bf16",
        combine,
        {"*": "*fp32", "out_ptr": "*bf16"},
        {"GROUP": 4, "HEAD_DIM": 128, "G_PAD": 16},
    )
    compile_one(
        "checksum",
        triton_checksum._kernel(),
        {"*": "*i64"},
        {"BLOCK": triton_checksum.BLOCK, "GOLDEN": triton_checksum.GOLDEN, "MIX": triton_checksum.MIX},
    )


if __name__ == "__main__":
    main()
