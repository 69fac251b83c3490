"""The linears of small batches on CPU (fp32): one hand-written C++ kernel on a panel copy of
each weight.

A decode step multiplies every weight by a few rows, one per sequence: its time goes to
reading the weights from memory (SmolLM2: 538 MB a step, each byte once), yet neither of
torch's GEMMs streams them at the memory's speed there. On the Zen 4 VM (BENCHMARKS.md, "the
decode step's linears on a hand-written panel kernel"), oneDNN's inner product on its packed
copy read SmolLM2's linears at 20-25 GB/s at 1-8 rows, slowest on the narrow ones (q/k/v, o:
12-17 GB/s inside a step), and ``F.linear`` (MKL, the plain weight) at 8-12 GB/s; this kernel
reads them at 31-39 GB/s at 1-8 rows (1.1-1.9x oneDNN's speed at 1-64 rows; at 256, a prompt's
rows, oneDNN is 1.3x faster).

The layout: the weight ``[N, K]`` cut into panels of ``PANEL`` output rows, each stored
transposed, ``[K, PANEL]`` contiguous (``pack``; the last panel padded with zeros), so that
one panel is one sequential stream. The kernel: the threads take the panels one at a time, in
order (OpenMP's dynamic schedule: the two threads read neighbouring panels, and a thread that
the OS preempts for the serving path's work does not hold the others up until it is back, as a
fixed split would; alone, 14.6 against 17.3 ms at one row). For a block of up to ``MB`` input
rows and ``JB`` vectors of a panel's columns it keeps ``MB x JB`` accumulators in vector
registers (24 of AVX-512's 32; 12 of AVX2's 16) and, for each ``k``, loads the panel's ``JB``
vectors once, broadcasts each row's ``x[m, k]`` and adds their products (fused multiply-add).
Nothing is reduced across lanes and no accumulator leaves the registers until the panel's ``K``
are done. Wider batches take their rows ``MB`` at a time over a panel that stays in L2. The
first version, on ``at::vec::Vectorized`` arrays, kept its accumulators on the stack (g++
spilled them: 57 % of the FMA peak at best); this one holds GCC vector types, which stay in registers.

Each output is the same sequence of operations on its own input row and weight row, whatever
the batch size, the row block or the thread: a row's result does not depend on the batch
around it, and a fused q/k/v weight gives the separate layers' outputs bit for bit. The
summation order (k ascending, one FMA each: AVX-512 and AVX2 give the same bits) is not MKL's
nor oneDNN's, which differ from each other in the last bits too; the engine's greedy parity with
transformers is held by its tests on this path. Up to how many rows it is taken is timed at load against oneDNN
(``workers/models/parallel.py``, ``choose_plain_rows``); oneDNN keeps prompt chunks and wide
batches, where it runs at the FMA peak and this kernel does not.

**Coded panels** (``code``, ``CodedPanels``): a checkpoint dequantized from a block format keeps
in fp32 exactly what the format held, a few levels per group of inputs (SmolLM2's GGUF: Q4_1,
``d * q + m`` with 16 levels per 32 inputs of a row; Q8_0 for the embedding and tied head). Where
every group of ``GROUP`` consecutive k's of every output row lies on such a grid, found and
checked bit for bit at load, the kernel reads one byte a weight (the panel layout) and a step and
offset per group and output row, makes each weight in registers with one FMA (``d * q`` is exact,
so it is the fp32 weight itself) and runs the same tile: the outputs equal the fp32 panels' bit
for bit, from a quarter of the bytes (SmolLM2: 168 MB a step instead of 538). A batch of more than
one row block makes each panel's weights once, into a per-thread buffer in L2, and runs the fp32
tile over it. A weight with any group off its grid (a trained fp32 checkpoint) keeps fp32 panels.

The kernels are ``csrc/panels.cpp`` and ``csrc/panels_coded.cpp`` (their tiles in ``panels.h``, the
vector type in ``vector.h``, which ``cpu_prefill``'s kernel shares), built once per machine
through ``build.py``; where one cannot be built, the small batches keep ``F.linear`` (or the
fp32 panels) (``available`` and ``coded_available`` say which).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from workers.backends.cpu import build as loader

PANEL = 48  # output rows per panel: 3 AVX-512 vectors, 6 AVX2 ones
GROUP = 32  # k's per step and offset of coded panels (CodedPanels): GGUF's block size
MAX_ROWS = 64  # the widest batch the kernel takes (oneDNN wins from some width up: timed at load)


@functools.cache
def build(max_vector_floats: int = 16) -> Any:
    """The kernel (``csrc/panels.cpp``) compiled for this CPU, using vectors of at most
    ``max_vector_floats`` floats (16: AVX-512 where the CPU has it; 8: AVX2 + FMA; 4: plain vector
    code). Below 16 only for the tests, which check each path this CPU can run."""
    return loader.kernel("panels", panel=PANEL, max_vl=max_vector_floats)


@functools.cache
def build_coded(max_vector_floats: int = 16) -> Any:
    """The kernel on coded panels (``CodedPanels``, ``csrc/panels_coded.cpp``), as ``build``."""
    return loader.kernel("panels_coded", panel=PANEL, group=GROUP, max_vl=max_vector_floats)


@functools.cache
def available() -> bool:
    """Whether the kernel on fp32 panels builds here (asked once per process; a failure is
    logged and the small batches keep ``F.linear``)."""
    return loader.usable("panels")


@functools.cache
def coded_available() -> bool:
    """Whether the kernel on coded panels builds here too (a failure is logged and every weight
    keeps fp32 panels: ``panels_for``)."""
    return available() and loader.usable("panels.coded")


# build.py's registry (the lambdas look ``build``/``build_coded`` up when called: tests replace them)
loader.register("panels", loader.SelfCheck("CPU panel", "F.linear for small batches", lambda: build()))
loader.register("panels.coded", loader.SelfCheck("coded CPU panel", "fp32 panels", lambda: build_coded()))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The panel copy of an fp32 ``weight`` ``[N, K]``: ``[ceil(N / PANEL), K, PANEL]``, each
    panel ``PANEL`` output rows transposed, the last one padded with zeros."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    with torch.no_grad():
        padded = weight.new_zeros(num_panels * PANEL, k)
        padded[:n] = weight
        return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()


@dataclass(frozen=True, slots=True)
class CodedPanels:
    """A weight's panels held as one byte a weight: ``codes`` ``[ceil(N / PANEL), K, PANEL]``
    (uint8, laid out as ``pack``'s panels) and, per ``GROUP`` consecutive k's of each output
    row, a step ``d`` and an offset ``m`` (``scales`` ``[ceil(N / PANEL), K / GROUP, 2,
    PANEL]``, fp32), such that ``fma(d, code, m)`` is the fp32 weight, bit for bit (a -0.0 as
    0.0, which changes no output: ``_code_rows``; ``code`` builds them only where that holds)."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


# Steps tried for a group of GROUP weights, as (the group's spread or its largest magnitude,
# divided by): the levels of the block formats a dequantized checkpoint comes from (GGUF's Q4_1:
# 16 levels from the group's minimum; Q8_0: 127 steps each side of zero; Q5_1: 32 levels;
# Q4_0 and Q5_0: the largest magnitude is 8 or 16 steps; plain 8-bit: 256 levels), each tried as
# an fp16 and as an fp32 number, in that order; the first that reproduces a group codes it.
_STEP_GUESSES = (
    ("spread", 15),
    ("magnitude", 127),
    ("spread", 31),
    ("magnitude", 8),
    ("magnitude", 16),
    ("spread", 255),
)


def _code_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``code`` on rows ``w`` ``[n, K / GROUP, GROUP]``: (codes, d, m) or None."""
    lo = w.amin(-1, keepdim=True)
    spread = w.amax(-1, keepdim=True) - lo
    magnitude = w.abs().amax(-1, keepdim=True)
    done = torch.zeros(lo.shape, dtype=torch.bool)
    codes = torch.zeros(w.shape, dtype=torch.uint8)
    step = torch.zeros(lo.shape)
    for what, by in _STEP_GUESSES:
        base = (spread.double() if what == "spread" else magnitude.double()) / by
        for dtype in (torch.float16, torch.float32):
            d = torch.where(spread == 0, 0.0, base.to(dtype).float())
            # the kernel computes fma(d, q, m), which is fp32's d * q + m where d * q is exact:
            # a step of at most 16 significant bits (its low 8 mantissa bits clear) times a code
            # below 2 ** 8, in the normal range
            bits = d.view(torch.int32)
            exact = ((bits & 0xFF) == 0) & ((d == 0) | (d.abs() >= 2.0**-100))
            q = ((w - lo) / torch.where(d == 0, 1.0, d)).round_()
            good = exact & ~done & ((q >= 0) & (q <= 255)).all(-1, keepdim=True)
            # == takes a -0.0 weight (GGUF's Q4_0/Q5_0 with a negative step give some) back as
            # 0.0: no output changes, since the accumulators start at +0.0 and a round-to-nearest
            # sum is -0.0 only when both addends are
            good &= (d * q + lo == w).all(-1, keepdim=True)
            if bool(good.any()):
                codes = torch.where(good, q.clamp_(0, 255).to(torch.uint8), codes)
                step = torch.where(good, d, step)
                done |= good
                if bool(done.all()):
                    return codes, step.squeeze(-1), lo.squeeze(-1)
    return None


FIRST_ROWS = 16  # the rows ``code`` tries first: enough to refuse a weight that does not code


def code(weight: torch.Tensor, chunk_rows: int = 4096) -> CodedPanels | None:
    """The coded panels of an fp32 ``weight`` ``[N, K]`` whose every group of ``GROUP``
    consecutive k's takes at most 256 evenly spaced values: what a weight dequantized from a
    block format holds (a GGUF file's Q4_*/Q8_0 tensors converted to fp32, as ``pdserve pull``
    does). Each group's step and offset are found from its values and checked: the coded
    weight is the fp32 weight bit for bit, or None (any other weight, K not a multiple of
    ``GROUP``), and the kernel keeps the fp32 panels. Rows are coded ``chunk_rows`` at a time
    (the check's temporaries stay small), after a first ``FIRST_ROWS``: a weight that does not
    code (a trained fp32 checkpoint's) is refused on its first rows, not after every step has been
    tried on all of it (a 3072 x 768 random weight took 0.36 s to refuse, against 6 ms to pack)."""
    n, k = weight.shape
    if k % GROUP or k == 0 or weight.dtype != torch.float32 or not bool(torch.isfinite(weight).all()):
        return None
    parts = []
    with torch.no_grad():
        start, size = 0, FIRST_ROWS
        while start < n:
            part = _code_rows(weight[start : start + size].reshape(-1, k // GROUP, GROUP))
            if part is None:
                return None
            parts.append(part)
            start, size = start + size, chunk_rows
        q = torch.cat([p[0] for p in parts]).reshape(n, k)
        d = torch.cat([p[1] for p in parts])
        m = torch.cat([p[2] for p in parts])
        num_panels = -(-n // PANEL)
        rows = num_panels * PANEL
        codes = q.new_zeros(rows, k)  # padding rows: code 0, d 0, m 0, the weight 0
        codes[:n] = q
        scales = d.new_zeros(rows, k // GROUP, 2)
        scales[:n, :, 0] = d
        scales[:n, :, 1] = m
        return CodedPanels(
            codes=codes.view(num_panels, PANEL, k).transpose(1, 2).contiguous(),
            scales=scales.view(num_panels, PANEL, k // GROUP, 2).permute(0, 2, 3, 1).contiguous(),
        )


Panels = torch.Tensor | CodedPanels  # what ``linear`` multiplies with: ``pack``'s or ``code``'s


def panels_for(weight: torch.Tensor, coded: bool = True) -> Panels:
    """The kernel's copy of ``weight``: coded where that is exact (``coded``; a quarter of the
    bytes a step streams, the same products, where the coded kernel builds), else ``pack``'s
    fp32 panels."""
    return (code(weight) if coded and coded_available() else None) or pack(weight)


def takes(x: torch.Tensor) -> bool:
    """Whether ``linear`` takes ``x``: fp32 on CPU, 1..``MAX_ROWS`` rows, outside
    ``torch.compile`` (a graph keeps ``F.linear``)."""
    k = x.shape[-1]
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and k > 0
        and 0 < x.numel() // k <= MAX_ROWS
        and not torch.compiler.is_compiling()
    )


def linear(
    x: torch.Tensor,
    panels: Panels,
    out_features: int,
    bias: torch.Tensor | None = None,
    kernel: Any = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``pack(weight)`` or ``code(weight)``, for ``x``
    ``[..., K]`` that ``takes`` accepts: ``[..., out_features]``. ``kernel``: a ``build``
    (``build_coded`` for coded panels; default: this CPU's)."""
    default, weights = kernel_for(panels)
    return run_kernel(kernel or default, x, weights, out_features, bias)


def kernel_for(panels: Panels) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """The kernel this CPU runs on ``panels`` and the tensors it reads them from."""
    if isinstance(panels, CodedPanels):
        return build_coded(), (panels.codes, panels.scales)
    return build(), (panels,)


def run_kernel(
    kernel: Any, x: torch.Tensor, weights: tuple[torch.Tensor, ...], out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """Call a kernel that takes ``x``, its ``weights``, then (bias, out, M, N, K, has_bias,
    threads) (this module's and ``cpu_amx``'s), on ``x`` ``[..., K]`` fp32: ``[..., out_features]``."""
    k = x.shape[-1]
    rows = x.numel() // k
    x2 = x.reshape(rows, k).contiguous()  # a no-op where it already is
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    kernel(
        x2,
        *weights,
        bias if bias is not None else x2,  # any fp32 tensor: not read without a bias
        out,
        rows,
        out_features,
        k,
        int(bias is not None),
        torch.get_num_threads(),
    )
    return out
