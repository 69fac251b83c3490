"""The panel kernel for small batches (``workers/layers/cpu_linear.py``) against a float64
reference: shapes that do not fill a panel or a vector, every row count it takes (a row block
boundary included), biases, and its batch invariance (a row's output does not depend on the
rows around it)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from workers.layers import cpu_linear

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
