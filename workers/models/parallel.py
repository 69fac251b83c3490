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

How a linear multiplies is its backend's (``impl``, set by ``Backend.prepare_linears``); without
one it is ``F.linear`` on the plain weight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.config import ModelConfig
from workers.transfer.tp_plan import heads_of_rank

if TYPE_CHECKING:
    from workers.backends.base import LinearImpl


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in its tensor-parallel group, and the process group of the model's
    collectives (a ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` made outside torch.distributed's
    global state). ``process_group`` is None at world size 1, and in a rank that only loads
    weights (tests): its layers can be built and loaded, not run.

    A collective's ``wait()`` takes no timeout: on NCCL it then only orders the current stream
    after the collective and the CPU runs on (a timeout would block the thread until the
    collective is done), and under a CUDA graph it can be captured. A stuck rank is the process
    group's own timeout's to catch (gloo's per op, NCCL's watchdog), set where the group is made."""

    rank: int = 0
    world_size: int = 1
    process_group: Any = None

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
        self._group().allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._group().allgather([parts], [x]).wait()
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


class ParallelLinear(nn.Module):
    """A linear layer's ``weight`` (and ``bias``) and, once a backend has prepared it, ``impl``:
    the backend's implementation of ``x @ weight.T + bias`` (for example a prepacked copy of the
    weight). A step multiplies with ``impl`` where it applies, else with ``F.linear``."""

    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.impl: LinearImpl | None = None  # a plain attribute: not in state_dict, not moved by .to()

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        impl = self.impl
        if impl is not None and impl.applies(x):
            return impl(x, bias)
        return F.linear(x, self.weight, bias)


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a rank's parameter comes from in the checkpoint: the full tensor's shape (checked
    against the file) and the index of the rank's part of it (read alone, by ``get_slice``)."""

    full_shape: tuple[int, ...]
    index: tuple[slice, ...]


class ColumnParallelLinear(ParallelLinear):
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


class RowParallelLinear(ParallelLinear):
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


class VocabParallelEmbedding(ParallelLinear):
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
