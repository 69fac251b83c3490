"""The panel kernel for small batches (``workers/backends/cpu/panels.py``) against a float64
reference: shapes that do not fill a panel or a vector, every row count it takes (a row block
boundary included), biases, and its batch invariance (a row's output does not depend on the
rows around it)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from workers.backends.cpu import panels as cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="the panel kernel did not build (no C++ compiler)")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return (out if b is None else out + b.double()).float()


@pytest.mark.parametrize(
    ("n", "k"),
    [(576, 576), (960, 576), (576, 1536), (97, 100), (5, 7), (cpu_linear.PANEL + 1, 33), (200, 16)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_float64_product(n, k, bias):
    torch.manual_seed(n * 1000 + k)
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    panels = cpu_linear.pack(w)
    assert panels.shape == (-(-n // cpu_linear.PANEL), k, cpu_linear.PANEL)
    for rows in range(1, cpu_linear.MAX_ROWS + 1):
        x = torch.randn(rows, k)
        out = cpu_linear.linear(x, panels, n, b)
        assert out.shape == (rows, n)
        # fp32 sums of k products of unit normals: errors grow like sqrt(k) ulps of the sum
        torch.testing.assert_close(out, _reference(x, w, b), rtol=0, atol=2e-6 * k)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=4e-6 * k)  # both off the exact sum


def _vector_widths() -> list[int]:
    """The kernel's vector paths this CPU runs: AVX-512 (16 floats), AVX2 + FMA (8), plain (4)."""
    flags = open("/proc/cpuinfo").read().split() if sys.platform == "linux" else []
    return [w for w, need in ((16, {"avx512f"}), (8, {"avx2", "fma"}), (4, set())) if need <= set(flags)]


@pytest.mark.parametrize("width", _vector_widths())
def test_every_vector_path_this_cpu_runs(width):
    """The build here takes the widest path; the narrower ones are what other CPUs run (CI's may
    have no AVX-512): each built and checked on the shapes that cut panels and row blocks."""
    kernel = cpu_linear.build(width)
    torch.manual_seed(width)
    for n, k in ((97, 100), (576, 576), (cpu_linear.PANEL * 2 + 5, 33)):
        w, b = torch.randn(n, k), torch.randn(n)
        panels = cpu_linear.pack(w)
        x = torch.randn(cpu_linear.MAX_ROWS, k)
        whole = cpu_linear.linear(x, panels, n, b, kernel=kernel)
        torch.testing.assert_close(whole, _reference(x, w, b), rtol=0, atol=2e-6 * k)
        for rows in (1, 3, 4, 5, 8, 9):  # both sides of a row block (8 rows with AVX-512, else 4)
            assert torch.equal(cpu_linear.linear(x[:rows], panels, n, b, kernel=kernel), whole[:rows]), (width, rows)


def test_a_rows_output_does_not_depend_on_the_batch():
    torch.manual_seed(0)
    w, b = torch.randn(300, 576), torch.randn(300)
    panels = cpu_linear.pack(w)
    x = torch.randn(cpu_linear.MAX_ROWS, 576)
    whole = cpu_linear.linear(x, panels, 300, b)
    for rows in (1, 3, 8, 9):  # 8 and 9: both sides of a row block (AVX-512: 8 rows)
        assert torch.equal(cpu_linear.linear(x[:rows], panels, 300, b), whole[:rows]), rows
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], panels, 300, b) for i in range(x.shape[0])])
    assert torch.equal(alone, whole)


def test_leading_dimensions_and_strided_inputs():
    torch.manual_seed(1)
    w = torch.randn(64, 40)
    panels = cpu_linear.pack(w)
    x = torch.randn(2, 3, 40)
    assert cpu_linear.takes(x)
    out = cpu_linear.linear(x, panels, 64)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, _reference(x.reshape(6, 40), w, None).reshape(2, 3, 64), rtol=0, atol=1e-4)
    strided = torch.randn(4, 80)[:, ::2]  # not contiguous
    torch.testing.assert_close(cpu_linear.linear(strided, panels, 64), _reference(strided, w, None), rtol=0, atol=1e-4)


def test_takes_small_fp32_cpu_batches_only():
    assert cpu_linear.takes(torch.randn(1, 8))
    assert cpu_linear.takes(torch.randn(cpu_linear.MAX_ROWS, 8))
    assert not cpu_linear.takes(torch.randn(cpu_linear.MAX_ROWS + 1, 8))  # a prompt chunk: oneDNN's
    assert not cpu_linear.takes(torch.randn(0, 8))
    assert not cpu_linear.takes(torch.randn(1, 8, dtype=torch.bfloat16))
    assert not cpu_linear.takes(torch.randn(1, 8, dtype=torch.float64))


# --- coded panels: weights dequantized from a block format, one byte a weight ---------------


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (torch.equal takes -0.0 for 0.0)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _dequantized(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """An fp32 weight as ``pdserve pull`` gets it from a GGUF file: quantized to ``kind`` and
    dequantized by the ``gguf`` package (what transformers' GGUF loader calls)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    kind_ = gguf.GGMLQuantizationType[kind]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    return torch.from_numpy(dequantize(quantize(w, kind_), kind_).astype("float32").reshape(n, k).copy())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_a_dequantized_weight_codes_to_the_same_products(kind):
    """The coded panels give the fp32 panels' outputs bit for bit: each coded weight is the fp32
    weight exactly and the sums run in the same order. So every parity guarantee of the fp32
    kernel holds for the coded one."""
    n, k = 200, 576
    w, b = _dequantized(kind, n, k, seed=len(kind)), torch.randn(n)
    coded = cpu_linear.code(w)
    assert coded is not None
    assert coded.codes.dtype == torch.uint8 and coded.codes.shape == (-(-n // cpu_linear.PANEL), k, cpu_linear.PANEL)
    padded = coded.codes.shape[0] * cpu_linear.PANEL
    assert coded.nbytes == padded * k * (1 + 8 / cpu_linear.GROUP)  # a byte a weight, two fp32 numbers per group
    panels = cpu_linear.pack(w)
    x = torch.randn(cpu_linear.MAX_ROWS, k)
    for rows in (1, 2, 5, 8, 9, 17, cpu_linear.MAX_ROWS):
        for bias in (None, b):
            want = cpu_linear.linear(x[:rows], panels, n, bias)
            assert _same_bits(cpu_linear.linear(x[:rows], coded, n, bias), want), rows


@pytest.mark.parametrize("width", _vector_widths())
def test_the_coded_kernel_on_every_vector_path_this_cpu_runs(width):
    w = _dequantized("Q4_1", cpu_linear.PANEL * 2 + 5, 64, seed=width)
    n, k = w.shape
    coded, panels = cpu_linear.code(w), cpu_linear.pack(w)
    assert coded is not None
    x = torch.randn(9, k)
    for rows in (1, 4, 5, 8, 9):
        got = cpu_linear.linear(x[:rows], coded, n, kernel=cpu_linear.build_coded(width))
        assert _same_bits(got, cpu_linear.linear(x[:rows], panels, n, kernel=cpu_linear.build(width))), (width, rows)


def test_coding_finds_each_groups_own_step_and_keeps_constant_groups():
    """Groups of one weight may come from different formats' steps (a Q8_0 embedding beside
    Q4_1 rows), and a group of equal values has no step at all."""
    q41, q80 = _dequantized("Q4_1", 48, 64, seed=1), _dequantized("Q8_0", 48, 64, seed=2)
    w = torch.cat([q41, q80])
    w[3, 32:64] = 0.25  # a constant group
    w[4, 0:32] = torch.where(w[4, 0:32] == w[4, 0:32].min(), w[4, 0:32], 0.0)  # zeros on the grid ...
    w[4, 5] = -0.0  # ... one of them -0.0, coded as 0.0: the same sums (accumulators start at +0.0)
    coded = cpu_linear.code(w)
    assert coded is not None
    x = torch.randn(3, 64)
    x[:, 32:] = 0.0  # row 4's outputs are sums of its -0.0/0.0 products alone
    assert _same_bits(cpu_linear.linear(x, coded, 96), cpu_linear.linear(x, cpu_linear.pack(w), 96))


def test_weights_that_do_not_code_exactly_keep_the_fp32_panels():
    torch.manual_seed(3)
    assert cpu_linear.code(torch.randn(64, 64)) is None  # a trained fp32 weight: no steps
    q = _dequantized("Q4_1", 64, 64, seed=3)
    assert cpu_linear.code(q[:, :48]) is None  # K not whole groups of 32
    nudged = q.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))  # one weight off its group's grid
    assert cpu_linear.code(nudged) is None
    with_nan = q.clone()
    with_nan[0, 0] = float("nan")
    assert cpu_linear.code(with_nan) is None
    assert isinstance(cpu_linear.panels_for(nudged), torch.Tensor)
    assert isinstance(cpu_linear.panels_for(q), cpu_linear.CodedPanels)


def test_a_coded_kernel_that_does_not_build_leaves_the_fp32_panels(monkeypatch):
    """The two kernels build apart: a coded one that fails takes nothing from the fp32 panels."""

    def no_build(*args, **kwargs):
        raise RuntimeError("no compiler for this one")

    q = _dequantized("Q4_1", 64, 64, seed=4)
    monkeypatch.setattr(cpu_linear, "build_coded", no_build)
    cpu_linear.coded_available.cache_clear()
    try:
        assert cpu_linear.available() and not cpu_linear.coded_available()
        panels = cpu_linear.panels_for(q)
        assert isinstance(panels, torch.Tensor)
        x = torch.randn(3, 64)
        assert torch.allclose(cpu_linear.linear(x, panels, 64), _reference(x, q, None), rtol=1e-5, atol=1e-5)
    finally:
        cpu_linear.coded_available.cache_clear()
