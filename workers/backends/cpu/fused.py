"""Small CPU (fp32) steps of the engine, one C++ call each instead of several aten ops, bit for
bit what those ops compute: the residual add with the RMSNorm after it (``add_rms_norm``),
rotary position embedding (``rotary``), the KV cache write of K and V (``kv_write``) and the
greedy sampler's argmax (``argmax``).

Eager, ``F.rms_norm`` is a composite of seven aten ops on CPU (``pow``, ``sum`` and ``div_`` for
the mean, ``add_``, ``rsqrt``, two ``mul``), the decoder adds the residual before each norm (one
more op), rotary embedding is five (``neg``, ``cat``, two ``mul``, ``add``) and the KV write two
``index_copy_``. A decode step at batch 8 runs 61 norms, 60 adds, 30 rotations and 30 writes on
tensors of a few KB (SmolLM2): each op is a dispatch, an allocation and a pass over memory
(~25-30 us a norm or a rotation). aten's ``argmax`` reads 0.4-0.8 G values a second here: 0.5 ms
for 8 rows of SmolLM2's 49152 logits. In the engine's c8 workload (BENCHMARKS.md, seventh
session) the norms with their adds were a quarter of the time the profiler saw in aten ops;
with all four kernels the engine ran it 1.17x faster (``bench/elementwise.py``).

**The norm.** ``add_rms_norm`` writes ``h = x + residual`` and ``w * (h * r)`` with
``r = 1 / sqrt(mean(h * h) + eps)`` for each row, in one call. To stay exact it does each
operation as aten does:

- ``h + residual``, ``h * h``, ``h * r`` and ``w * (h * r)`` are elementwise, one rounding each
  (built with ``-ffp-contract=off``: no fused multiply-add; the products commute bit for bit);
- the mean is aten's ``sum`` then ``div_`` by the row length, and the sum follows aten's order
  for a contiguous inner reduction (``vectorized_inner_sum`` in ``SumKernel.cpp``): the row cut
  into vectors of ``W`` floats, summed lane by lane in four interleaved rows through
  ``multi_row_sum``'s cascade of levels, the four rows added in order, the scalar tail past the
  last whole vector summed apart, then the lanes added into it one by one. ``W`` is found, not
  assumed: torch 2.13's sum adds 8-float vectors on this AVX-512 CPU as on AVX2 (with 16, only
  11-16 of 30 random rows matched);
- ``rsqrt`` is ``1 / sqrt`` (both of aten's paths, vector and scalar).

**Rotary embedding** (``rotary``): ``x * cos + rotate_half(x) * sin`` per element, the negation
and both products rounded as aten rounds them, read from a strided view (the fused q/k/v
output's q and k heads) and written contiguous.

**The KV write and the argmax** copy rows (a slot out of range raises ``IndexError``, as
``index_copy_`` does) and pick, per row, the first index of the largest value, NaN counting as
largest and -0 equal to +0, as aten's ``argmax`` does (each vector lane keeps its first largest
value and where it is; the lanes then give the smallest such index).

**Checked, not trusted.** ``norm_width`` tries each vector width against ``F.rms_norm``,
``rotary_usable`` the rotation against the eager ops and ``argmax_usable`` the argmax against
aten's (ties, NaN, infinities, signed zeros), bit for bit, once per process (row lengths with
and without a tail, row counts on both sides of the threads' split) before the engine uses
them; a difference, or a build that fails, leaves aten's ops, and the log says why.
Rows are independent, so the threads split the rows of a wide batch with the same bits.

The kernels are ``csrc/fused_*.cpp``, built and checked through ``build.py`` (its one loader and
its registry of self-checks), as the panel kernels are.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from workers.backends.base import Ops
from workers.backends.cpu import build as loader

_REFERENCE = Ops()

PARALLEL_ROWS = 64  # batches of at least this many rows split their rows over the threads
NORM_WIDTHS = (8, 16)  # the vector widths (floats) tried for aten's order of sums
# aten's elementwise loops run tensors below this many elements (at::internal::GRAIN_SIZE) in one
# serial pass; the SwiGLU kernel copies that pass's split between vector and scalar exp
SWIGLU_MAX_ELEMENTS = 32768
NORM_MIN = 64  # narrower rows keep F.rms_norm (aten sums rows shorter than a vector another way)

KERNELS = ("norm", "rotary", "argmax", "kv_write", "swiglu", "bitmask")  # csrc/fused_<name>.cpp
_PARAMS = {"norm": {"parallel_rows": PARALLEL_ROWS}, "rotary": {"parallel_rows": PARALLEL_ROWS}}


@functools.cache
def build(kernel: str) -> Any:
    """``kernel`` (a ``KERNELS`` name: ``csrc/fused_<kernel>.cpp``, its arguments there) compiled
    for this CPU, once per process (``build.py``'s cache keeps it between processes)."""
    if kernel not in KERNELS:
        raise KeyError(kernel)
    return loader.kernel(f"fused_{kernel}", **_PARAMS.get(kernel, {}))


def _cpu_fp32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors)


# ---------------------------------------------------------------------------------- the norm
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, F.rms_norm(h, weight, eps))`` with ``h = x + residual`` (``x`` itself without a
    residual), for contiguous fp32 ``x`` (and ``residual``) ``[..., n]`` and ``weight`` ``[n]``
    (``norm_takes``). ``width``: the vector width of the sums (default: ``norm_width()``)."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    build("norm")(
        x,
        residual if residual is not None else x,  # any fp32 tensor: not read without a residual
        h,
        weight,
        out,
        x.numel() // n,
        n,
        int(residual is not None),
        float(eps),
        width or norm_width(),
        torch.get_num_threads(),
    )
    return h, out


def _norm_check(width: int) -> str | None:
    """Why the kernel at ``width`` differs from aten's add and ``F.rms_norm`` here (None: it does not)."""
    gen = torch.Generator().manual_seed(0)
    for n in (576, 64, 100, 2048, 4096 + 24):
        for rows in (1, 3, PARALLEL_ROWS + 1):
            x = torch.randn(rows, n, generator=gen) * 3.0
            res = torch.randn(rows, n, generator=gen)
            w = torch.rand(n, generator=gen) + 0.5
            h, ours = add_rms_norm(x, res, w, 1e-5, width)
            ref = F.rms_norm(x + res, (n,), w, 1e-5)
            if not torch.equal(h, x + res) or not torch.equal(ours, ref):
                return f"rows {rows}, width {n}: up to {(ours - ref).abs().max().item():.3g} from F.rms_norm"
    return None


@functools.cache
def _norm_widths() -> tuple[int | None, str]:
    """The first of ``NORM_WIDTHS`` at which the kernel equals ``F.rms_norm`` here, and why each
    other width does not (the kernel built)."""
    whys = {width: _norm_check(width) for width in NORM_WIDTHS}
    for width, why in whys.items():
        if why is None:
            return width, ""
    return None, (
        f"(torch's CPU capability {torch.backends.cpu.get_cpu_capability()}) "
        + "; ".join(f"{width}-float vectors: {why}" for width, why in whys.items())
    )


def _norm_self_check() -> str | None:
    width, why = _norm_widths()
    return None if width is not None else why


@functools.cache
def norm_width() -> int | None:
    """The vector width (floats) at which the kernel's sums equal aten's on this CPU, tried
    against ``F.rms_norm`` bit for bit once per process; None where the kernel does not build or
    no width matches (logged: the model keeps aten's ops)."""
    return _norm_widths()[0] if loader.usable("fused.norm") else None


def norm_takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``add_rms_norm`` runs for these tensors (CPU fp32, contiguous, eager, checked here)."""
    return (
        _cpu_fp32(x, weight, residual)
        and x.shape[-1] >= NORM_MIN
        and x.is_contiguous()
        and (residual is None or residual.is_contiguous())
        and not torch.compiler.is_compiling()
        and norm_width() is not None
    )


# ---------------------------------------------------------------------------------- rotary
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for fp32 ``x`` ``[T, heads, D]`` (its heads contiguous,
    its rows any stride apart) and ``cos``/``sin`` ``[T, 1, D]`` contiguous: ``[T, heads, D]``."""
    rows, heads, d = x.shape
    out = torch.empty(rows, heads, d, dtype=torch.float32)
    build("rotary")(x, cos, sin, out, rows, x.stride(0), heads, d, torch.get_num_threads())
    return out


# The reference's arithmetic in aten ops: what the model runs where a kernel does not, and what
# each kernel is checked against.
eager_rotary = _REFERENCE.rotary
eager_swiglu = _REFERENCE.swiglu


def _rotary_check() -> str | None:
    gen = torch.Generator().manual_seed(0)
    for d in (64, 128, 40):
        for rows in (1, 3, PARALLEL_ROWS + 1):
            wide = torch.randn(rows, 5, d, generator=gen) * 4.0
            x = wide[:, 1:4]  # a strided view, as the fused q/k/v output's heads
            angles = torch.rand(rows, 1, d, generator=gen) * 100.0
            cos, sin = angles.cos(), angles.sin()
            if not torch.equal(rotary(x, cos, sin), eager_rotary(x, cos, sin)):
                return f"head dim {d}, {rows} rows differ from aten's"
    return None


@functools.cache
def rotary_usable() -> bool:
    """Whether the rotary kernel builds here and equals ``eager_rotary`` bit for bit."""
    return loader.usable("fused.rotary")


def rotary_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotary`` runs for these tensors (CPU fp32, heads contiguous, eager, checked here)."""
    return (
        _cpu_fp32(x, cos, sin)
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.is_contiguous()
        and sin.is_contiguous()
        and not torch.compiler.is_compiling()
        and rotary_usable()
    )


# ---------------------------------------------------------------------------------- argmax
def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for fp32 ``logits`` ``[N, V]`` (rows any stride apart): ``[N]``
    int64. aten's argmax reads ~0.4 G values a second here (1 ms for 8 rows of SmolLM2's 49152)."""
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.long)
    build("argmax")(logits, out, rows, v, logits.stride(0), torch.get_num_threads())
    return out


def _argmax_check() -> str | None:
    gen = torch.Generator().manual_seed(0)
    for v in (49152, 100, 7, 16):
        rows = torch.randn(6, v, generator=gen)
        rows[1] = rows[1].round()  # ties: the first index wins
        rows[2, v // 3] = float("nan")
        rows[2, v // 2] = float("nan")
        rows[3] = float("-inf")
        rows[4, v - 1] = float("inf")
        rows[5] = 0.0
        rows[5, v // 2 :] = -0.0
        for view in (rows, torch.cat([rows, rows], dim=1)[:, :v]):
            if not torch.equal(argmax(view), view.argmax(dim=-1)):
                return f"{v} values a row differ from aten's"
    return None


@functools.cache
def argmax_usable() -> bool:
    """Whether the argmax kernel builds here and picks aten's index on rows with ties, NaN,
    infinities and signed zeros."""
    return loader.usable("fused.argmax")


def argmax_takes(logits: torch.Tensor) -> bool:
    """Whether ``argmax`` runs for these logits (CPU fp32 ``[N, V]``, each row contiguous, eager)."""
    return (
        _cpu_fp32(logits)
        and logits.dim() == 2
        and logits.stride(1) == 1
        and not torch.compiler.is_compiling()
        and argmax_usable()
    )


# ------------------------------------------------------------------------------ token bitmask
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """``Ops.apply_token_bitmask`` for CPU fp32 ``logits`` ``[N, V]`` (rows contiguous) and an
    int32 ``bitmask`` ``[>= N, words]`` (contiguous); skips the words that allow every token."""
    index = torch.tensor(rows, dtype=torch.long)
    build("bitmask")(
        logits,
        bitmask,
        index,
        len(rows),
        logits.shape[1],
        vocab,
        logits.stride(0),
        bitmask.shape[1],
        torch.get_num_threads(),
    )


def _bitmask_check() -> str | None:
    gen = torch.Generator().manual_seed(0)
    for vocab, width in ((49152, 49152), (100, 128), (33, 33)):
        words = (vocab + 31) // 32
        for fill in ("random", "ones", "zeros"):
            bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
            if fill != "random":
                bitmask[1:3] = -1 if fill == "ones" else 0
            for rows in ([0, 1, 2, 3, 4], [1, 3]):
                logits = torch.randn(5, width, generator=gen)
                expected = logits.clone()
                _REFERENCE.apply_token_bitmask(expected, bitmask, rows, vocab)
                apply_token_bitmask(logits, bitmask, rows, vocab)
                if not torch.equal(logits, expected):
                    return f"a {fill} mask over {vocab} tokens differs from the reference"
    return None


@functools.cache
def bitmask_usable() -> bool:
    """Whether the bitmask kernel builds here and masks as the reference does."""
    return loader.usable("fused.bitmask")


def bitmask_takes(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    return (
        _cpu_fp32(logits)
        and logits.dim() == 2
        and logits.stride(1) == 1
        and bitmask.dtype == torch.int32
        and bitmask.is_contiguous()
        and bitmask_usable()
    )


# ---------------------------------------------------------------------------------- KV write
def kv_write(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``cache[0, slots] = k`` and ``cache[1, slots] = v`` in one call, for an fp32 layer cache
    viewed ``[2, num_slots, heads, dim]`` (contiguous), int64 ``slots`` ``[T]`` and ``k``/``v``
    ``[T, heads, dim]`` (heads contiguous, rows any stride apart: the fused q/k/v output's). A
    slot out of range raises ``IndexError``, as ``index_copy_`` does (the others are written)."""
    rows, heads, dim = k.shape
    bad = torch.zeros(1, dtype=torch.long)
    build("kv_write")(cache, slots, k, v, bad, rows, heads * dim, cache.shape[1], k.stride(0), v.stride(0))
    check_slots(bad, slots, cache.shape[1])


def check_slots(bad: torch.Tensor, slots: torch.Tensor, num_slots: int) -> None:
    """Raise ``IndexError`` as ``index_copy_`` does where the kernel counted slots out of range
    in ``bad`` (the others are written)."""
    if bad.item():
        raise IndexError(f"{bad.item()} KV slot(s) out of range [0, {num_slots}): {slots.tolist()}")


@functools.cache
def kv_write_usable() -> bool:
    """Whether the KV write kernel builds here (a copy: nothing to compare)."""
    return loader.usable("fused.kv_write")


def kv_write_takes(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``kv_write`` runs for these tensors (CPU fp32, layouts it reads, eager)."""
    return (
        _cpu_fp32(cache, k, v)
        and cache.is_contiguous()
        and slots.dtype == torch.long
        and slots.device.type == "cpu"
        and slots.is_contiguous()
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        and not torch.compiler.is_compiling()
        and kv_write_usable()
    )


# ---------------------------------------------------------------------------------- SwiGLU
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, fp32 ``gate_up`` ``[rows, 2 *
    inner]`` (columns contiguous, rows any stride apart; ``swiglu_takes``): ``[rows, inner]``."""
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inner, dtype=torch.float32)
    build("swiglu")(gate_up, out, rows, inner, gate_up.stride(0))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN with NaN of the same payload, -0 apart from +0)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _swiglu_check() -> str | None:
    gen = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, -0.0, 88.7, -88.7, 89.0, -104.0, 1e-30, -1e-30, 20.0, -20.0])
    specials = torch.cat([specials, torch.tensor([float("inf"), float("-inf"), float("nan")])])
    for inner in (1536, 64, 40, 100, 31):  # whole pairs of vectors, and tails of each length
        for rows in (1, 3, 8):
            if rows * inner >= SWIGLU_MAX_ELEMENTS:
                continue
            gate_up = torch.randn(rows, 2 * inner + 3, generator=gen) * 6.0
            flat = gate_up.view(-1)
            flat[torch.randint(0, flat.numel(), (len(specials),), generator=gen)] = specials
            view = gate_up[:, : 2 * inner]  # rows 2 * inner + 3 apart, as a wider fused output's
            if not _same_bits(swiglu(view), eager_swiglu(view)):
                return f"{rows} rows of {inner} differ from aten's"
    return None


@functools.cache
def swiglu_usable() -> bool:
    """Whether the SwiGLU kernel builds here and equals ``eager_swiglu`` bit for bit."""
    return loader.usable("fused.swiglu")


def swiglu_takes(gate_up: torch.Tensor) -> bool:
    """Whether ``swiglu`` runs for ``gate_up``: CPU fp32, 2-D, columns contiguous, eager, checked
    here, and fewer than ``SWIGLU_MAX_ELEMENTS`` outputs (aten's silu runs such a tensor in one
    serial loop a row at a time, the split between vector and scalar ``exp`` the kernel copies;
    a larger one is cut over the threads at places that depend on their number)."""
    return (
        _cpu_fp32(gate_up)
        and gate_up.dim() == 2
        and gate_up.stride(1) == 1
        and gate_up.shape[1] % 2 == 0
        and gate_up.shape[0] * gate_up.shape[1] // 2 < SWIGLU_MAX_ELEMENTS
        and not torch.compiler.is_compiling()
        and swiglu_usable()
    )


def describe() -> str:
    """One log line: which of the kernels run here (running their self-checks, once a process)."""
    kernels = {
        "residual add + RMSNorm": norm_width() is not None,
        "rotary embedding": rotary_usable(),
        "KV cache write": kv_write_usable(),
        "greedy argmax": argmax_usable(),
        "SwiGLU (decode rows)": swiglu_usable(),
    }
    used = [name for name, ok in kernels.items() if ok]
    left = [name for name, ok in kernels.items() if not ok]
    if not used:
        return "fused CPU kernels: none usable here; aten's ops run"
    return f"fused CPU kernels (bit for bit aten's, checked at load): {', '.join(used)}" + (
        f"; aten's ops for {', '.join(left)}" if left else ""
    )


# each kernel's build and its check against aten (build.py's registry: ``loader.usable``); the
# lambdas look ``build`` and the checks up when called (tests replace them)
loader.register(
    "fused.norm", loader.SelfCheck("fused RMSNorm", "F.rms_norm", lambda: build("norm"), lambda: _norm_self_check())
)
loader.register(
    "fused.rotary",
    loader.SelfCheck("fused rotary", "aten's rotation", lambda: build("rotary"), lambda: _rotary_check()),
)
loader.register(
    "fused.argmax", loader.SelfCheck("argmax", "aten's argmax", lambda: build("argmax"), lambda: _argmax_check())
)
loader.register("fused.kv_write", loader.SelfCheck("KV write", "index_copy_", lambda: build("kv_write")))
loader.register(
    "fused.bitmask",
    loader.SelfCheck("token bitmask", "the reference mask", lambda: build("bitmask"), lambda: _bitmask_check()),
)
loader.register(
    "fused.swiglu",
    loader.SelfCheck("fused SwiGLU", "aten's silu and mul", lambda: build("swiglu"), lambda: _swiglu_check()),
)
