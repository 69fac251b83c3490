"""CPU linears: oneDNN's prepacked weights, the panel kernel for small batches, AMX tiles for
wide ones; ``prepack_linears`` gives a model's linears these as their ``impl``.

**Prepacked CPU weights** (``prepack_linears``): on a CPU with oneDNN, an fp32 model's linears
(and the LM head) run oneDNN's inner-product on a copy of each weight reordered once, at load,
into the blocked layout its GEMM reads fastest; ``F.linear`` on the plain weight re-lays them
out on every call. One reorder serves every batch size, and every batch size runs faster for it
(docs/decisions/0003-onednn-prepacking-and-row-timing.md). The result differs from
``F.linear``'s in the last bits (another summation order), so the engine's greedy parity with
transformers is held by its tests with packing on. Linears that read the same input (q/k/v,
gate/up) are packed as one ``FusedPackedLinear``: one call per layer instead of three and two,
bit for bit the separate layers' outputs.

**Small batches on the panel kernel** (``choose_plain_rows``): a decode step multiplies each
weight by a few rows and only streams the weights, which oneDNN does well below the memory's
bandwidth (and ``F.linear`` further below). Packing also makes a panel copy of each weight for
``workers/backends/cpu/panels.py``, a hand-written kernel that streams it near that bandwidth at
a few rows (docs/decisions/0004-panel-kernel-for-small-batches.md). Which is
faster at a row count depends on the CPU, so after packing the linears are timed both ways at
1, 2, 4, 8, 16, 32 and 64 rows on the weights themselves, and batches up to the largest row count where
the kernel won (every smaller count winning too) take it: a decode step of that many sequences,
and the LM head's rows of any step. Where the kernel does not build, ``F.linear`` on the plain
weight is the small-batch side of the timing, as before it existed (on some CPUs MKL's GEMV
beats oneDNN at the smallest row counts; docs/decisions/0003-onednn-prepacking-and-row-timing.md).

**Wide batches on AMX tiles** (``amx_tiles``, ``wide_linear``): on a CPU with Intel AMX, a coded
weight also gets bf16 tiles of its codes (``workers/backends/cpu/amx.py``), and batches wider than
``plain_rows`` multiply on them instead of oneDNN (fp32 products and sums; faster than oneDNN at
those widths: docs/decisions/0006-amx-tiles-for-wide-batches.md). The timing above then weighs
the panel kernel against them.

**Memory**: the plain weight stays (the compiled path traces ``F.linear`` on it, inductor packs
its own; the embedding looks rows up in it; the other paths fall back to it), so on CPU fp32 the
linears' weights take three times their memory: plain, oneDNN's and the panels, or 2.3 times where
the panels are coded (``cpu_linear.code``: a byte a weight and two fp32 numbers per 32; a
checkpoint dequantized from a block format, such as SmolLM2's GGUF), 2.8 times with AMX tiles too
(two bytes a weight) (``prepack_weights=False`` keeps only the plain one, at the speed of ``F.linear``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workers.backends.cpu import amx as cpu_amx
from workers.backends.cpu import panels as cpu_linear
from workers.models.parallel import ParallelLinear, VocabParallelEmbedding


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _rows(x: torch.Tensor) -> int:
    """The rows an input multiplies: its elements over its last dimension (tokens, flattened)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, panels: cpu_linear.Panels | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """A small batch (up to ``plain_rows``): the panel kernel on ``panels``
    (``workers/backends/cpu/panels.py``) where it takes ``x``, else ``F.linear`` on the plain weight."""
    if panels is not None and cpu_linear.takes(x):
        return cpu_linear.linear(x, panels, weight.shape[0], bias)
    return F.linear(x, weight, bias)


def small_op_name() -> str:
    """What small batches multiply with here, for the start-up lines."""
    return "the panel kernel" if cpu_linear.available() else "F.linear"


def wide_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    panels: cpu_linear.Panels | None,
    tiles: torch.Tensor | None,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A batch wider than ``plain_rows``: AMX's tiles on a coded weight's ``tiles``
    (``workers/backends/cpu/amx.py``), else oneDNN's inner product on its ``packed`` copy."""
    if tiles is not None and isinstance(panels, cpu_linear.CodedPanels):
        return cpu_amx.linear(x, panels, tiles, out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def wide_op_name(model: nn.Module) -> str:
    """What batches wider than ``plain_rows`` multiply with, for the start-up lines."""
    return "AMX tiles" if wide_on_amx(_packed_units(model)) else "oneDNN"


def wide_on_amx(units: list[PackedWeights | FusedPackedLinear]) -> bool:
    """Whether batches wider than ``plain_rows`` multiply on AMX tiles: some unit holds them."""
    return any(unit.tiles is not None for unit in units)


def _runs_packed(x: torch.Tensor) -> bool:
    """Whether ``x`` is multiplied with a oneDNN-packed weight: eager (a compiled graph keeps
    ``F.linear`` on the plain weight, and inductor packs its own) and fp32."""
    return x.dtype == torch.float32 and not torch.compiler.is_compiling()


class PackedWeights:
    """One linear's CPU implementation (``ParallelLinear.impl``): a oneDNN copy of its weight
    reordered once, the panel kernel's copy (``cpu_linear.panels_for``) and, for coded panels
    where AMX runs, AMX tiles; inputs of up to ``plain_rows`` rows take ``small_linear``, wider
    ones ``wide_linear``. Outside ``torch.compile`` only (inside, the graph keeps ``F.linear`` on
    the plain weight and inductor's freezing packs it its own way)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int, coded: bool, amx: bool):
        self.weight = weight  # the module's plain weight (a reference, not a copy)
        self.bias = bias  # the module's bias, for the lean decode path's calls
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.panels: cpu_linear.Panels | None = (
            cpu_linear.panels_for(weight.detach(), coded) if cpu_linear.available() else None
        )
        self.tiles = amx_tiles(self.panels) if amx else None
        self.plain_rows = 0  # inputs of up to this many rows take small_linear (choose_plain_rows)

    def applies(self, x: torch.Tensor) -> bool:
        return _runs_packed(x)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if _rows(x) <= self.plain_rows:  # a small batch (an empty one too: oneDNN rejects it)
            return small_linear(x, self.weight, self.panels, bias)
        return wide_linear(x, self.packed, self.panels, self.tiles, self.weight.shape[0], bias)


def packable(weight: torch.Tensor) -> bool:
    """Whether ``prepack_linears`` packs this weight: fp32 on a CPU with oneDNN."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_linear_available()


class FusedPackedLinear:
    """Column-parallel linears that read the same input (a layer's q/k/v, or gate/up) multiplied
    as one: oneDNN's inner product on their weights (and biases) concatenated by output row and
    reordered once. One call instead of three (or two) per layer, and a wider GEMM; each output
    column is still the dot product of its own weight row, and the output equals the separate
    layers' concatenated (bit for bit in ``tests/unit/test_prepacked_linears.py``).

    The plain weights are concatenated too, and each layer's ``weight`` becomes a view of its
    rows (one plain copy, as before). Inputs of up to ``plain_rows`` rows (``choose_plain_rows``)
    take the panel kernel on the fused weight's panels (``small_linear``; where it does not
    build, one ``F.linear`` on the fused plain weight)."""

    def __init__(self, linears: list[ParallelLinear], batch_hint: int, coded: bool = True, amx: bool = True) -> None:
        biases = [b.detach() for m in linears if (b := getattr(m, "bias", None)) is not None]
        if biases and len(biases) != len(linears):
            raise ValueError("fused linears must all have a bias or all have none")
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in linears])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch_hint)
            self.panels = cpu_linear.panels_for(self.weight, coded) if cpu_linear.available() else None
            self.tiles = amx_tiles(self.panels) if amx else None
            self.bias = torch.cat(biases) if biases else None
            start = 0
            for m in linears:  # each layer's weight: its rows of the fused one
                rows = m.weight.shape[0]
                m.weight.data = self.weight[start : start + rows]
                start += rows
        self.plain_rows = 0

    def applies(self, x: torch.Tensor) -> bool:
        """Whether ``__call__`` takes ``x``: as a packed linear would (``_runs_packed``), and a
        non-empty batch (oneDNN rejects an empty one; the separate layers answer it)."""
        return _runs_packed(x) and x.numel() > 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side, ``[..., the layers' output widths summed]``."""
        if _rows(x) <= self.plain_rows:
            return small_linear(x, self.weight, self.panels, self.bias)
        return wide_linear(x, self.packed, self.panels, self.tiles, self.weight.shape[0], self.bias)


def prepack_linears(model: nn.Module, batch_hint: int = 8, coded: bool = True, amx: bool = True) -> int:
    """Pack every linear of ``model`` for oneDNN (see the module's docstring), and of its
    vocabulary tables only ``model.head``, the one that scores (an untied embedding only looks
    up rows); the number of layers packed (0: not a CPU fp32 model, or no oneDNN). A module that
    names ``fused_inputs`` (linears reading the same input) gets them packed as one
    ``FusedPackedLinear`` in ``fused`` instead of copies of their own (each weight is packed once).
    ``coded``: the panel kernel's copies are coded where that is exact (``cpu_linear.panels_for``);
    ``amx``: coded ones get AMX tiles for wide batches where the CPU runs them (``amx_tiles``)."""
    head = getattr(model, "head", None)
    groups = []  # (module, its fused linears): packed once, as one, never each on its own
    for module in model.modules():
        linears = [getattr(module, name) for name in getattr(module, "fused_inputs", ())]
        if linears and all(packable(m.weight) for m in linears):
            groups.append((module, linears))
    fused = {id(m) for _, linears in groups for m in linears}
    packed = 0
    for m in model.modules():
        if not isinstance(m, ParallelLinear) or (isinstance(m, VocabParallelEmbedding) and m is not head):
            continue
        if id(m) in fused:
            packed += 1  # a fused layer counts: its group's copies serve it
        elif packable(m.weight):
            m.impl = PackedWeights(m.weight, getattr(m, "bias", None), batch_hint, coded, amx)
            packed += 1
    for module, linears in groups:
        setattr(module, "fused", FusedPackedLinear(linears, batch_hint, coded, amx))  # noqa: B010 - any nn.Module
    return packed


def amx_tiles(panels: cpu_linear.Panels | None) -> torch.Tensor | None:
    """AMX tiles for coded ``panels`` where this CPU runs the AMX kernel (``cpu_amx.available``),
    else None (fp32 panels: oneDNN keeps the wide batches)."""
    if isinstance(panels, cpu_linear.CodedPanels) and cpu_amx.available():
        return cpu_amx.tiles(panels)
    return None


def describe_amx(model: nn.Module) -> str | None:
    """One start-up line when wide batches run on AMX tiles: how many weights, and their bytes."""
    tiles = [unit.tiles for unit in _packed_units(model) if unit.tiles is not None]
    if not tiles:
        return None
    return (
        f"batches wider than the panel kernel's multiply {len(tiles)} coded weights on AMX's bf16 tiles "
        f"(each input cut into three exact bf16 parts: fp32 products and sums; "
        f"{sum(t.nbytes for t in tiles) / 1e6:.0f} MB of tiles)"
    )


def describe_coded(model: nn.Module) -> str | None:
    """One start-up line on the panel kernel's copies when some are coded: how many, and the bytes
    a step streams through the kernel against fp32 panels (None: none coded)."""
    panels = [unit.panels for unit in _packed_units(model) if unit.panels is not None]
    coded = [p for p in panels if isinstance(p, cpu_linear.CodedPanels)]
    if not coded:
        return None
    held = sum(p.nbytes for p in panels)
    as_fp32 = sum(p.codes.numel() * 4 if isinstance(p, cpu_linear.CodedPanels) else p.nbytes for p in panels)
    return (
        f"the panel kernel holds {len(coded)} of {len(panels)} weights as one byte a weight, exactly "
        f"(the checkpoint's fp32 values lie on per-{cpu_linear.GROUP} grids, as a block-quantized "
        f"source leaves them): {held / 1e6:.0f} MB a step instead of {as_fp32 / 1e6:.0f} MB"
    )


PLAIN_ROW_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes choose_plain_rows times, smallest first
PLAIN_ROWS_MARGIN = 0.05  # against oneDNN, the small-batch path keeps a row count only when it is this much faster


@dataclass(frozen=True, slots=True)
class PlainRowsTiming:
    """One row count's pass over a model's packed linears: the fastest of the rounds each way."""

    rows: int
    plain_s: float
    packed_s: float
    rounds: int
    plain_rounds_won: int  # rounds whose pair small_linear won by the margin (for the log)
    margin: float = PLAIN_ROWS_MARGIN  # 0 where the wide side is AMX tiles (margin_against)

    @property
    def plain_wins(self) -> bool:
        """The small-batch path (``small_linear``) keeps this row count: its best pass is
        ``margin`` faster than the wide path's best. Something else on the host only slows
        a pass, so the best of each is the measure it disturbs least; the rounds alternate the
        two ways, so both bests had the same chances. Counting rounds won instead (every round,
        or most) decided wrongly under a replica's start-up: a load spike lost the kernel a round
        it was clearly faster in, and the replica served small batches on oneDNN
        (docs/decisions/0003-onednn-prepacking-and-row-timing.md)."""
        return self.plain_s <= self.packed_s * (1 - self.margin)


def margin_against(units: list[PackedWeights | FusedPackedLinear]) -> float:
    """How much faster the small-batch path must be to keep a row count: ``PLAIN_ROWS_MARGIN``
    against oneDNN, the default the timing started from; none against AMX tiles, since both
    sides are then pdserve's own kernels and the faster at best serves: with the margin, a row
    count where the panel kernel is narrowly ahead would go to AMX tiles, and the engine's decode
    steps there run slower for it."""
    return 0.0 if wide_on_amx(units) else PLAIN_ROWS_MARGIN


def _packed_units(model: nn.Module) -> list[PackedWeights | FusedPackedLinear]:
    """The model's packed linears and fused groups: what a step multiplies through oneDNN."""
    units: list[PackedWeights | FusedPackedLinear] = []
    for module in model.modules():
        if isinstance(module, ParallelLinear) and isinstance(module.impl, PackedWeights):
            units.append(module.impl)
        fused = getattr(module, "fused", None)
        if isinstance(fused, FusedPackedLinear):
            units.append(fused)
    return units


def _set_plain_rows(units: list[PackedWeights | FusedPackedLinear], rows: int) -> None:
    for unit in units:
        unit.plain_rows = rows


TIMING_LOCK = Path(tempfile.gettempdir()) / "pdserve-cpu-timing.lock"


@contextlib.contextmanager
def timing_alone() -> Iterator[None]:
    """Hold the host's timing lock (``TIMING_LOCK``, an ``flock``) for the block: engines that
    start together on one host (a prefill and a decode replica, tensor-parallel ranks) time
    their linears one after another, not over each other. Timed side by side, each saw the
    other's passes and could choose the side that is slower when it runs alone
    (docs/decisions/0003-onednn-prepacking-and-row-timing.md). The lock is released when the
    block ends or the process dies."""
    try:
        fd = os.open(TIMING_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # another user's lock file, a read-only tmp: time without it
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def choose_plain_rows(model: nn.Module, rows: int | None = None, rounds: int = 5) -> tuple[int, list[PlainRowsTiming]]:
    """Set the row count up to which the packed linears of ``model`` take ``small_linear`` (see the
    module's docstring): ``rows`` when given, else measured on this CPU at its current thread
    count: each of ``PLAIN_ROW_CANDIDATES`` (smallest first) times one pass over every packed
    linear both ways, alternating, ``rounds`` times; the count is the largest before the first
    where ``small_linear``'s best pass is not ``margin_against(units)`` faster than the wide path's
    (``PlainRowsTiming.plain_wins``). Returns the count and what was timed (empty when given, or
    nothing is packed)."""
    units = _packed_units(model)
    if rows is not None or not units:
        _set_plain_rows(units, rows or 0)
        return rows or 0, []
    timings: list[PlainRowsTiming] = []
    chosen = 0
    margin = margin_against(units)
    with timing_alone(), torch.inference_mode():
        for candidate in PLAIN_ROW_CANDIDATES:
            inputs = [torch.randn(candidate, unit.weight.shape[1]) for unit in units]
            best = {candidate: float("inf"), 0: float("inf")}  # plain_rows -> the fastest pass
            won = 0
            for round_ in range(rounds + 1):  # round 0 warms both ways up and is not counted
                took: dict[int, float] = {}
                for plain_rows in best:
                    _set_plain_rows(units, plain_rows)
                    start = time.perf_counter()
                    _pass(units, inputs)
                    took[plain_rows] = time.perf_counter() - start
                if round_:
                    best = {k: min(v, took[k]) for k, v in best.items()}
                    won += took[candidate] <= took[0] * (1 - margin)
            timing = PlainRowsTiming(candidate, best[candidate], best[0], rounds, won, margin)
            timings.append(timing)
            if not timing.plain_wins:
                break
            chosen = candidate
    _set_plain_rows(units, chosen)
    return chosen, timings


def _pass(units: list[PackedWeights | FusedPackedLinear], inputs: list[torch.Tensor]) -> None:
    for unit, x in zip(units, inputs, strict=True):
        if isinstance(unit, FusedPackedLinear):
            unit(x)
        else:
            unit(x, unit.bias)
