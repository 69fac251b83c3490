"""Megatron-style tensor parallelism for the Llama family: which slice of each weight a rank
holds, and the few collectives that put the slices back together.

Per decoder layer: q/k/v and gate/up are column-parallel (each rank computes its own heads or
its own slice of the MLP's inner width, no communication), o_proj and down_proj are row-parallel
(each rank multiplies its slice of the inputs; one all-reduce sums the partial outputs). The
embedding is split by vocabulary rows (a rank looks up the ids it holds, zeros elsewhere, one
all-reduce), and so is the LM head (each rank scores its vocabulary rows; an all-gather joins
them). A tied head reuses the embedding's shard.

Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
otherwise each KV head is replicated on the ``tp / num_kv_heads`` ranks whose query heads use it
(rank r holds KV head ``r * num_kv_heads // tp``).

At world size 1 (``TPGroup()``) every layer is the plain op of the unsharded model, with no
collective: the same arithmetic as ``nn.Linear`` / ``nn.Embedding``, bit for bit.

**Prepacked CPU weights** (``prepack_linears``): on a CPU with oneDNN, an fp32 model's linears
(and the LM head) run oneDNN's inner-product on a copy of each weight reordered once, at load,
into the blocked layout its GEMM reads fastest; ``F.linear`` on the plain weight re-lays them
out on every call. One reorder serves every batch size. ``bench/packed_linear.py`` measured
SmolLM2's 211 linears 1.2-2.5x faster this way (batch 1-32, one or two threads). The result
differs from ``F.linear``'s in the last bits (another summation order; |diff| ~1e-6), so the
engine's greedy parity with transformers is held by its tests with packing on. Linears that
read the same input (q/k/v, gate/up) are packed as one ``FusedPackedLinear``: one call per layer
instead of three and two, bit for bit the separate layers' outputs.

**Small batches on the panel kernel** (``choose_plain_rows``): a decode step multiplies each
weight by a few rows and only streams the weights, which oneDNN does at 20-25 GB/s on a VM that
streams 30-40 (and ``F.linear`` at 8-12). Packing also makes a panel copy of each weight for
``workers/backends/cpu/panels.py``, a hand-written kernel that streams it at 31-39 GB/s at 1-8
rows there (SmolLM2's linears 1.1-1.9x oneDNN's speed at 1-64 rows; BENCHMARKS.md). Which is
faster at a row count depends on the CPU, so after packing the linears are timed both ways at
1, 2, 4, 8, 16, 32 and 64 rows on the weights themselves, and batches up to the largest row count where
the kernel won (every smaller count winning too) take it: a decode step of that many sequences,
and the LM head's rows of any step. Where the kernel does not build, ``F.linear`` on the plain
weight is the small-batch side of the timing, as before it existed (on an Intel VM streaming ~13
GB/s a core, MKL's GEMV beat oneDNN at 1-2 rows).

**Wide batches on AMX tiles** (``amx_tiles``, ``wide_linear``): on a CPU with Intel AMX, a coded
weight also gets bf16 tiles of its codes (``workers/backends/cpu/amx.py``), and batches wider than
``plain_rows`` multiply on them instead of oneDNN (fp32 products and sums; 1.3-1.7x oneDNN on
SmolLM2's linears at 8-2048 rows). The timing above then weighs the panel kernel against them.

**Memory**: the plain weight stays (the compiled path traces ``F.linear`` on it, inductor packs
its own; the embedding looks rows up in it; the other paths fall back to it), so on CPU fp32 the
linears' weights take three times their memory: plain, oneDNN's and the panels, or 2.3 times where
the panels are coded (``cpu_linear.code``: a byte a weight and two fp32 numbers per 32; a
checkpoint dequantized from a block format, such as SmolLM2's GGUF), 2.8 times with AMX tiles too
(two bytes a weight) (``prepack_weights=False`` keeps only the plain one, at the speed of ``F.linear``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.backends.cpu import amx as cpu_amx
from workers.backends.cpu import panels as cpu_linear
from workers.models.config import ModelConfig
from workers.transfer.tp_plan import heads_of_rank


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in its tensor-parallel group, and the process group of the model's
    collectives (a ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` made outside torch.distributed's
    global state). ``process_group`` is None at world size 1, and in a rank that only loads
    weights (tests): its layers can be built and loaded, not run."""

    rank: int = 0
    world_size: int = 1
    process_group: Any = None
    timeout: timedelta = timedelta(seconds=60)  # a collective waiting longer fails (a stuck rank)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    def _group(self) -> Any:
        if self.process_group is None:
            raise RuntimeError(f"rank {self.rank} of {self.world_size} has no process group to run a collective on")
        return self.process_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return x
        self._group().allreduce([x]).wait(self.timeout)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._group().allgather([parts], [x]).wait(self.timeout)
        return torch.cat(parts, dim=-1)

    def even_shard(self, size: int, what: str) -> slice:
        """This rank's part of ``size`` split evenly."""
        if size % self.world_size:
            raise ValueError(f"{what} {size} is not divisible by tensor_parallel_size {self.world_size}")
        n = size // self.world_size
        return slice(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds: its even share, or the one head its query heads use
        when there are fewer KV heads than ranks (replicated)."""
        return heads_of_rank(num_kv_heads, self.world_size, self.rank)  # the transfer plan's rule too


def tensor_parallel_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``cfg`` cannot be split over ``tp`` ranks, or None when it can."""
    if cfg.num_heads % tp:
        return f"the model's {cfg.num_heads} attention heads do not split over {tp} ranks"
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return (
            f"the model's {cfg.num_kv_heads} KV heads neither split over {tp} ranks "
            f"nor replicate onto them ({tp} is not a multiple of {cfg.num_kv_heads})"
        )
    if cfg.intermediate_size % tp:
        return f"the model's MLP width {cfg.intermediate_size} does not split over {tp} ranks"
    return None


def rank_model_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The model as one rank sees it: its local query and KV heads. The paged KV cache sized
    and built from this holds the rank's KV heads of every block."""
    if tp.world_size == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // tp.world_size, num_kv_heads=len(tp.kv_heads(cfg.num_kv_heads))
    )


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


def wide_on_amx(units: list[PackedLinear | FusedPackedLinear]) -> bool:
    """Whether batches wider than ``plain_rows`` multiply on AMX tiles: some unit holds them."""
    return any(unit.tiles is not None for unit in units)


def _runs_packed(x: torch.Tensor) -> bool:
    """Whether ``x`` is multiplied with a oneDNN-packed weight: eager (a compiled graph keeps
    ``F.linear`` on the plain weight, and inductor packs its own) and fp32."""
    return x.dtype == torch.float32 and not torch.compiler.is_compiling()


class PackedLinear(nn.Module):
    """A linear layer's ``weight`` (and ``bias``), and, once ``pack`` has run, a oneDNN copy of
    the weight that ``_linear`` multiplies with outside ``torch.compile`` (inside, the graph
    keeps ``F.linear`` on the plain weight and inductor's freezing packs it its own way)."""

    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.packed: torch.Tensor | None = None  # a plain attribute: not in state_dict, not moved by .to()
        self.panels: cpu_linear.Panels | None = None  # the panel kernel's copy (cpu_linear.panels_for), with packed
        self.tiles: torch.Tensor | None = None  # coded panels' AMX tiles (cpu_amx.tiles), where AMX runs
        self.plain_rows = 0  # inputs of up to this many rows take small_linear, not wide_linear (choose_plain_rows)

    def packable(self) -> bool:
        """Whether ``pack`` packs this weight: fp32 on a CPU with oneDNN."""
        w = self.weight
        return w.device.type == "cpu" and w.dtype == torch.float32 and _onednn_linear_available()

    def pack(self, batch_hint: int, coded: bool = True, amx: bool = True) -> bool:
        """Reorder the weight for oneDNN (``batch_hint``: the batch size the layout is picked
        for; any batch runs on it), and cut it into the panel kernel's panels (``coded``: one
        byte a weight where that is exact, ``cpu_linear.panels_for``; ``amx``: coded panels get
        AMX tiles for wide batches where the CPU runs them, ``amx_tiles``). Only what
        ``packable`` accepts; False otherwise."""
        w = self.weight
        if not self.packable():
            return False
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        self.panels = cpu_linear.panels_for(w.detach(), coded) if cpu_linear.available() else None
        self.tiles = amx_tiles(self.panels) if amx else None
        return True

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None or not _runs_packed(x):
            return F.linear(x, self.weight, bias)
        if _rows(x) <= self.plain_rows:  # a small batch (an empty one too: oneDNN rejects it)
            return small_linear(x, self.weight, self.panels, bias)
        return wide_linear(x, self.packed, self.panels, self.tiles, self.weight.shape[0], bias)


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

    def __init__(self, linears: list[PackedLinear], batch_hint: int, coded: bool = True, amx: bool = True) -> None:
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
        if linears and all(m.packable() for m in linears):
            groups.append((module, linears))
    fused = {id(m) for _, linears in groups for m in linears}
    packed = sum(
        id(m) in fused or m.pack(batch_hint, coded, amx)  # a fused layer counts: its group's copies serve it
        for m in model.modules()
        if isinstance(m, PackedLinear) and (not isinstance(m, VocabParallelEmbedding) or m is head)
    )
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
        two ways, so both bests had the same chances. Counting rounds won decided wrongly under
        a replica's start-up: once with every round required (the kernel 1.22x faster at best at
        4 rows, one round of three lost: run 24), once with most required (1.65x faster at best
        at 2 rows, 2 rounds of 5 won: run 29); both replicas served batch 8 on oneDNN."""
        return self.plain_s <= self.packed_s * (1 - self.margin)


def margin_against(units: list[PackedLinear | FusedPackedLinear]) -> float:
    """How much faster the small-batch path must be to keep a row count: ``PLAIN_ROWS_MARGIN``
    against oneDNN, the default the timing started from; none against AMX tiles, since both
    sides are then pdserve's own kernels and the faster at best serves. At 8 rows on the AMX
    VM the panel kernel timed 22.1 ms against AMX's 22.8 (within 5 %: AMX took batch-8 decode
    steps), and the engine alone ran c8 2-3 % faster with the panel kernel there (BENCHMARKS.md)."""
    return 0.0 if wide_on_amx(units) else PLAIN_ROWS_MARGIN


def _packed_units(model: nn.Module) -> list[PackedLinear | FusedPackedLinear]:
    """The model's packed linears and fused groups: what a step multiplies through oneDNN."""
    units: list[PackedLinear | FusedPackedLinear] = []
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.packed is not None:
            units.append(module)
        fused = getattr(module, "fused", None)
        if isinstance(fused, FusedPackedLinear):
            units.append(fused)
    return units


def _set_plain_rows(units: list[PackedLinear | FusedPackedLinear], rows: int) -> None:
    for unit in units:
        unit.plain_rows = rows


TIMING_LOCK = Path(tempfile.gettempdir()) / "pdserve-cpu-timing.lock"


@contextlib.contextmanager
def timing_alone() -> Iterator[None]:
    """Hold the host's timing lock (``TIMING_LOCK``, an ``flock``) for the block: engines that
    start together on one host (a prefill and a decode replica, tensor-parallel ranks) time
    their linears one after another, not over each other. Timed side by side, each saw the
    other's passes: a disaggregated 1+1 start on 2 cores measured oneDNN at 73.9 ms against
    F.linear's 47.7 at one row and chose F.linear, which alone runs that row 1.12x slower
    (BENCHMARKS.md, 2026-12-05). The lock is released when the block ends or the process dies."""
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


def _pass(units: list[PackedLinear | FusedPackedLinear], inputs: list[torch.Tensor]) -> None:
    for unit, x in zip(units, inputs, strict=True):
        if isinstance(unit, FusedPackedLinear):
            unit(x)
        else:
            unit._linear(x, getattr(unit, "bias", None))


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a rank's parameter comes from in the checkpoint: the full tensor's shape (checked
    against the file) and the index of the rank's part of it (read alone, by ``get_slice``)."""

    full_shape: tuple[int, ...]
    index: tuple[slice, ...]


class ColumnParallelLinear(PackedLinear):
    """``y[:, rows] = x @ W[rows].T + b[rows]``: this rank's slice of the outputs, no collective.
    ``rows`` defaults to the rank's even share of ``out_features``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, rows: slice | None = None) -> None:
        super().__init__()
        rows = rows if rows is not None else tp.even_shard(out_features, "output width")
        n = rows.stop - rows.start
        self.weight = nn.Parameter(torch.empty(n, in_features))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None
        self.shards = {"weight": Shard((out_features, in_features), (rows,))}
        if bias:
            self.shards["bias"] = Shard((out_features,), (rows,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class RowParallelLinear(PackedLinear):
    """``y = sum over ranks of x[:, cols] @ W[:, cols].T``, then ``+ b``: the input arrives split
    (a column-parallel layer's output), one all-reduce joins the partial products."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        cols = tp.even_shard(in_features, "input width")
        self.weight = nn.Parameter(torch.empty(out_features, cols.stop - cols.start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # whole: added once, after the sum
        self.shards = {"weight": Shard((out_features, in_features), (slice(None), cols))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._linear(x, self.bias)
        y = self.tp.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(PackedLinear):
    """The embedding split by vocabulary rows, ``ceil(vocab / tp)`` per rank (the last rank's
    rows past the vocabulary are zeros that no id reaches). A lookup takes the rows this rank
    holds, zeros for the rest, and an all-reduce adds the ranks' results: each id's row comes
    from exactly one rank, so the sum is exact. ``logits`` scores hidden states against the
    same rows (a tied LM head)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = min(vocab_size, tp.rank * per_rank)
        self.vocab_stop = min(vocab_size, self.vocab_start + per_rank)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))
        self.shards = {"weight": Shard((vocab_size, hidden_size), (slice(self.vocab_start, self.vocab_stop),))}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_stop - self.vocab_start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ E.T`` over the whole vocabulary: each rank scores its rows, an all-gather
        joins them (each logit is computed whole on one rank: no change in rounding)."""
        local = self._linear(hidden, None)
        if self.tp.world_size == 1:
            return local
        return self.tp.all_gather(local)[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the embedding's vocabulary split, used through ``logits`` only."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)
