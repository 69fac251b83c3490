"""Prompt-sized linears on coded weights with Intel AMX: fp32 products from bf16 tile
multiplies, on CPUs that have AMX (Sapphire Rapids and later Xeons).

A prompt step multiplies every weight by hundreds or thousands of rows; it is bound by the
FMA units, and oneDNN runs fp32 near their peak. AMX's tile multiply (``TDPBF16PS``: a 16 x 32
by 32 x 16 bf16 product added into 16 x 16 fp32 accumulators) does 16 times the multiply-adds a
cycle of AVX-512's fp32 FMAs, but on bf16 inputs, which hold 8 of fp32's 24 significant bits.
Two facts make it exact enough to stand in for fp32 here:

* **The weights**: a coded weight (``cpu_linear.CodedPanels``) is ``d * q + m`` per group of 32
  inputs, with ``q`` an integer in 0..255, which bf16 holds exactly. So ``x . w`` over a group is
  ``d * (x . q) + m * sum(x)``, and only ``x . q`` needs the tiles.
* **The inputs**: an fp32 ``x`` is the sum of three bf16 numbers exactly (``hi``: its top 8
  significant bits, ``mid`` the next 8, ``lo`` the last 8; cut by truncation, so each rest is
  exact). Each product of a bf16 part and a code is exact in fp32, and the tiles add them in fp32.

So each group's ``x . q`` is the sum of exact products (96: 32 inputs x 3 parts) in fp32, as an
fp32 GEMM's would be, in another order; then ``d * that + m * sum(x)`` per group, added up in
fp32 (AVX-512). The result differs from the fp32 panels' in the last bits, as oneDNN's and MKL's
do from each other (the engine's greedy parity with transformers is held by its tests on this
path). Two limits of AMX: bf16 subnormals count as zero (an input part below ~1e-38 — an input
below ~1e-33 — is dropped) and fp32 results below ~1e-38 flush to zero.

The work: 3 tile multiplies where an fp32 GEMM does one, at 16 times the rate, plus per group
and 16 x 16 block a store of the accumulators and two FMAs a row (the scale and the offset). The
codes wait as bf16 tiles made once at load (``tiles``: ``[num_panels, 3, K / 32, 16, 32]``, two
bytes a weight, in the layout ``TDPBF16PS`` reads: pairs of k's side by side); the inputs are cut
into parts once per call. The threads take (row chunk, panel) pairs, so a chunk's parts stay in
L2 while the panels stream past.

The kernel is ``csrc/amx.cpp`` (its functions built for the AMX target), built through
``build.py`` as ``cpu_linear``'s are. ``available`` says whether this CPU and kernel allow it
(the CPU flags, Linux's permission to use the tile state, the build, and a check of one product
against float64); where not, prompts keep oneDNN.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from workers.backends.cpu import build as loader
from workers.backends.cpu import panels as cpu_linear

TILE_ROWS = 16  # rows of a tile: input rows per block, and k pairs per group (32 k's)
BLOCK = 16  # output columns per tile: a panel of cpu_linear.PANEL is 3 of them
CHUNK_BLOCKS = 8  # 16-row blocks a work item: their input parts stay in L2 while its panel goes past


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def build() -> Any:
    """The kernel (``csrc/amx.cpp``), compiled once per machine (``build.py``)."""
    return loader.kernel("amx", panel=cpu_linear.PANEL, group=cpu_linear.GROUP, chunk_blocks=CHUNK_BLOCKS)


def _self_check() -> bool:
    """One coded product against float64: the kernel runs and agrees here."""
    n, k = cpu_linear.PANEL * 2 + 5, 64
    q = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16  # every group holds 0..15
    w = q.float() * 0.0625 - 0.5  # d = 1/16, m = -1/2: on a Q4_1 grid
    coded = cpu_linear.code(w)
    if coded is None:
        return False
    x = torch.randn(TILE_ROWS * 2 + 3, k, generator=torch.Generator().manual_seed(0))
    want = (x.double() @ w.double().T).float()
    return bool(torch.allclose(linear(x, coded, tiles(coded), n), want, rtol=1e-5, atol=1e-5))


def _permit() -> bool:
    """Ask Linux for AMX's tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``):
    a process gets it only on request, and a tile instruction without it is a SIGILL."""
    import ctypes

    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 Linux
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0


def _check() -> str | None:
    """Why the built kernel may not run here (None: it may): Linux's permission, one product."""
    if not _permit():
        return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    if not _self_check():
        return "its product disagreed with float64"
    return None


@functools.cache
def available() -> bool:
    """Whether prompts on coded weights may take the AMX kernel here (asked once per process):
    x86-64 Linux with AMX's tile and bf16 units and AVX-512, Linux's permission to use the tile
    state, a build, and one product that agrees with float64. Logged when it does not."""
    if not _has_amx():
        return False  # no AMX: nothing to say
    return loader.usable("amx")


def _has_amx() -> bool:
    return sys.platform == "linux" and {"amx_tile", "amx_bf16", "avx512f", "avx512bw"} <= _cpu_flags()


loader.register(
    "amx",
    loader.SelfCheck(
        "AMX", "oneDNN for prompt-sized linears", lambda: build(), lambda: _check(), warm=((),) if _has_amx() else ()
    ),
)


def tiles(coded: cpu_linear.CodedPanels) -> torch.Tensor:
    """The codes of ``coded`` as the kernel's bf16 tiles (two bytes a weight): ``[num_panels, 3,
    K / 32, 16, 32]``, for each panel's three blocks of 16 output columns and each group, a tile
    of 16 pairs of k's by the block's 16 columns, a pair's two codes side by side."""
    num_panels, k, panel = coded.codes.shape
    with torch.no_grad():
        q = coded.codes.to(torch.bfloat16)  # 0..255: exact
        q = q.view(num_panels, k // 2, 2, panel // BLOCK, BLOCK)  # [p, k pair, 2, block, column]
        q = q.permute(0, 3, 1, 4, 2)  # [p, block, k pair, column, 2]
        return q.contiguous().view(torch.int16).view(num_panels, panel // BLOCK, k // cpu_linear.GROUP, 16, 32)


def linear(
    x: torch.Tensor,
    coded: cpu_linear.CodedPanels,
    tiles_: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the weight ``coded`` holds (``tiles_``: its ``tiles``),
    ``x`` fp32 ``[..., K]`` on CPU: ``[..., out_features]``."""
    return cpu_linear.run_kernel(build(), x, (tiles_, coded.scales), out_features, bias)
