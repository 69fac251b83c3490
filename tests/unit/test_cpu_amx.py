"""The AMX kernel for wide batches on coded weights (``workers/backends/cpu/amx.py``) against a
float64 reference: every row count around its 16-row blocks, widths that do not fill a panel,
biases, and weights from each GGUF block format. Its sums are fp32 sums of exact products, so it
is held to fp32's accuracy (the bound below is what oneDNN's fp32 GEMM meets too)."""

from __future__ import annotations

import pytest
import torch

from workers.backends.cpu import amx as cpu_amx
from workers.backends.cpu import panels as cpu_linear

pytestmark = pytest.mark.skipif(not cpu_amx.available(), reason="no AMX on this CPU (or the kernel did not build)")

# |out - exact| <= BOUND * sum_k |x_k w_k|: fp32 rounding of K products' sum. Measured: 1-2e-7 for
# this kernel and 2-4e-7 for oneDNN's fp32 GEMM at K = 576 and 1536; the kernel with the inputs'
# low bf16 part dropped (two parts) gave 5.3e-6 at K = 576, and a misplaced tile gives garbage.
BOUND = 1e-6


def _dequantized(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    kind_ = gguf.GGMLQuantizationType[kind]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    return torch.from_numpy(dequantize(quantize(w, kind_), kind_).astype("float32").reshape(n, k).copy())


def _worst(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + 1e-30
    return float(((got.double() - exact).abs() / scale).max())


@pytest.mark.parametrize(
    ("kind", "n", "k"), [("Q4_1", 200, 576), ("Q8_0", 97, 64), ("Q4_0", 48, 1536), ("Q5_1", 3, 32)]
)
def test_fp32_accuracy_at_every_row_count(kind, n, k):
    w = _dequantized(kind, n, k, seed=n + k)
    coded = cpu_linear.code(w)
    assert coded is not None
    tiles = cpu_amx.tiles(coded)
    assert tiles.dtype == torch.int16 and tiles.shape == (coded.codes.shape[0], 3, k // 32, 16, 32)
    b = torch.randn(n)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k))
    for rows in (1, 15, 16, 17, 31, 33, 128, 129, 300):
        for bias in (None, b):
            got = cpu_amx.linear(x[:rows], coded, tiles, n, bias)
            assert got.shape == (rows, n)
            assert _worst(got, x[:rows], w, bias) <= BOUND, (rows, bias is not None)


def test_leading_dimensions_strided_inputs_and_a_row_that_does_not_depend_on_its_batch():
    w = _dequantized("Q4_1", 96, 128, seed=5)
    coded = cpu_linear.code(w)
    assert coded is not None
    tiles = cpu_amx.tiles(coded)
    x = torch.randn(2, 40, 256)[..., ::2]  # [2, 40, 128], not contiguous
    got = cpu_amx.linear(x, coded, tiles, 96)
    assert got.shape == (2, 40, 96)
    assert _worst(got.reshape(80, 96), x.reshape(80, 128), w, None) <= BOUND
    # each output row is its own row's sums: the same bits alone or among others
    alone = cpu_amx.linear(x[1, 7:8].contiguous(), coded, tiles, 96)
    assert torch.equal(alone[0], got[1, 7])


def test_inputs_far_from_one_keep_their_relative_accuracy():
    """The three bf16 parts carry every bit of an fp32 input at any magnitude (in bf16's normal
    range): large and small inputs are as accurate as inputs near one."""
    w = _dequantized("Q4_1", 48, 64, seed=6)
    coded = cpu_linear.code(w)
    assert coded is not None
    tiles = cpu_amx.tiles(coded)
    x = torch.randn(20, 64) * torch.logspace(-20, 20, 20)[:, None]
    assert _worst(cpu_amx.linear(x, coded, tiles, 48), x, w, None) <= BOUND
