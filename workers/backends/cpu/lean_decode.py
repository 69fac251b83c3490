"""A decode step on CPU fp32 as one loop of kernel calls, without the module tree in between.

Why: a small model's decode step spends much of its main thread outside any kernel, in Python
and aten's dispatch walking the layers' modules (thousands of Python calls and aten ops a step:
views, ``empty``, ``split``, ``contiguous``, the checks each wrapper makes before it calls its
kernel), while the other OpenMP threads spin, waiting for the next parallel region
(docs/decisions/0008-lean-decode.md). Every kernel of the step is already
one call (the panel kernel's linears, ``cpu_fused``'s norm, rotary, KV write and SwiGLU,
``cpu_paged``'s attention); what is left between them is bookkeeping that is the same for every
layer and every step.

``LeanDecode`` does that bookkeeping once. At load (``for_model``, from ``load_model``) it
collects, per layer, the kernels and the weights they read (the fused q/k/v and gate/up
panels, o and down, the norms' weights); per step it makes the step's buffers once and runs
the layers as a flat sequence of kernel calls into them (the K/V slots checked once a step,
after the layers, as ``cpu_fused.kv_write`` checks them per layer).

**Exact, not approximately.** Each call is the call the module path makes, with the same
kernel, the same inputs and the same arguments (row counts, strides, threads, the norm's vector
width, the attention's splits): the hidden states equal the module path's bit for bit
(``tests/unit/test_lean_decode.py`` compares them over steps at several batches). q and k are
rotated in two calls into separate buffers where the module path rotates them in one (the
rotation is elementwise: the same bits), so the attention kernel reads q without a copy.

**Where it runs** (``LeanDecode.takes``): steps of decodes only (no prompt chunk), at most as
many rows as every linear sends to the panel kernel (``plain_rows``; wider decode batches go to
AMX tiles or oneDNN through the modules), a full-precision fp32 cache read by ``cpu_paged``'s
kernel, one rank, no q/k norm, and every ``cpu_fused`` kernel usable here. Everything else, and
``CPUOptions(lean_decode=False)`` (the benchmarks' baseline), runs the modules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workers.backends.base import FastDecode
from workers.backends.cpu import fused as cpu_fused
from workers.backends.cpu import paged as cpu_paged
from workers.backends.cpu import panels as cpu_linear
from workers.backends.cpu.attention import CPUPagedAttention, decode_kernel_usable

if TYPE_CHECKING:
    from workers.layers.kv_cache import PagedKVCache
    from workers.layers.paged_attention import PagedAttention
    from workers.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Linear:
    """One packed linear as the panel kernel takes it (``cpu_linear.run_kernel``'s call)."""

    kernel: Any
    weights: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @classmethod
    def of(cls, unit: Any) -> _Linear | None:
        panels = getattr(unit, "panels", None)
        if panels is None or getattr(unit, "packed", None) is None:
            return None
        kernel, weights = cpu_linear.kernel_for(panels)
        return cls(kernel, weights, getattr(unit, "bias", None), unit.weight.shape[0], unit.weight.shape[1])

    def __call__(self, x: torch.Tensor, out: torch.Tensor, rows: int, threads: int) -> None:
        bias = self.bias
        self.kernel(
            x,
            *self.weights,
            bias if bias is not None else x,
            out,
            rows,
            self.out_features,
            self.in_features,
            int(bias is not None),
            threads,
        )


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    post_norm: torch.Tensor  # post_attention_layernorm's weight
    post_eps: float
    next_norm: torch.Tensor  # the next layer's input norm, or the model's final norm after the last
    next_eps: float


@dataclass(frozen=True, slots=True)
class _CacheViews:
    """Per layer: the flat ``[2, slots, heads, dim]`` view the KV write fills, and the K and V
    block views attention reads."""

    cache: PagedKVCache
    flat: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    paged_kernel: Any


class LeanDecode(FastDecode):
    """The decode step of one ``LlamaForCausalLM`` as a flat sequence of kernel calls (module
    docstring); built by ``for_model``."""

    def __init__(self, model: LlamaForCausalLM, layers: list[_Layer], units: list[Any]) -> None:
        cfg = model.config
        self.model = model
        self.layers = layers
        self.hidden = cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inner = layers[0].down.in_features
        first: RMSNorm = model.model.layers[0].input_layernorm  # type: ignore[assignment]
        self.first_norm, self.first_eps = first.weight, float(first.eps)
        self._units = units  # the packed linears behind the layers' (their plain_rows, read each step)
        self._views: _CacheViews | None = None

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> LeanDecode | None:
        """The plan for ``model``, or None where a decode step must run the modules (the reason
        at debug level)."""
        why = _static_problem(model)
        if why is None:
            found = _layers(model)
            if found is None:
                why = "a linear has no panel kernel copy"
            else:
                return cls(model, *found)
        logger.debug("decode steps run the modules: %s", why)
        return None

    @property
    def max_rows(self) -> int:
        """The widest decode batch that runs here: every linear takes it on the panel kernel."""
        return min(cpu_linear.MAX_ROWS, *(unit.plain_rows for unit in self._units))

    def takes(self, input_ids: torch.Tensor, attn: PagedAttention) -> bool:
        """Whether this step runs here: decodes only, few enough rows for every linear's panel
        kernel and for the SwiGLU kernel, ``cpu_paged``'s attention on a full-precision cache."""
        meta = attn.meta
        rows = input_ids.shape[0]
        kv = attn.kv
        return (
            0 < rows <= self.max_rows
            and rows * self.inner < cpu_fused.SWIGLU_MAX_ELEMENTS
            and isinstance(attn, CPUPagedAttention)
            and attn.decode_kernel_on
            and not meta.prefills
            and meta.num_decodes == rows
            and meta.write is not None
            and meta.decode_block_tables is not None
            and meta.decode_context_lens is not None
            and meta.decode_first_pos is not None
            and kv is not None
            and not kv.quantized
            and input_ids.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and self._cache_views(kv) is not None
        )

    def _cache_views(self, kv: PagedKVCache) -> _CacheViews | None:
        views = self._views
        if views is not None and views.cache is kv:
            return views
        probe = torch.empty(1, self.num_heads, self.head_dim)
        first = kv.layers[0]
        if first.dtype != torch.float32 or first.device.type != "cpu" or not decode_kernel_usable(probe, first[0]):
            return None
        _, block_size, num_kv_heads, head_dim = first[0].shape
        kernel = cpu_paged._kernel(block_size, num_kv_heads, self.num_heads // num_kv_heads, head_dim)
        self._views = _CacheViews(
            kv,
            [kv.flat(i) for i in range(len(kv.layers))],
            [layer[0] for layer in kv.layers],
            [layer[1] for layer in kv.layers],
            kernel,
        )
        return self._views

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """Hidden states after the final norm, ``[rows, hidden]``: what the model's forward gives
        for this step (``takes`` said yes)."""
        meta = attn.meta
        views = self._views
        assert views is not None and meta.write is not None
        assert meta.decode_block_tables is not None and meta.decode_first_pos is not None
        assert meta.decode_context_lens is not None
        model = self.model
        rows, hidden, hq, hkv, d = input_ids.shape[0], self.hidden, self.num_heads, self.num_kv_heads, self.head_dim
        threads = torch.get_num_threads()
        width = cpu_fused.norm_width()
        rotary, kv_write, norm, swiglu = (cpu_fused.build(k) for k in ("rotary", "kv_write", "norm", "swiglu"))

        x = model.model.embed_tokens(input_ids)
        cos, sin = model.model.rotary_emb.tables(positions, x.dtype)
        slots = meta.write.slots
        tables = meta.decode_block_tables
        if tables.stride(-1) != 1:
            tables = tables.contiguous()
        firsts, lens = meta.decode_first_pos.contiguous(), meta.decode_context_lens.contiguous()
        blocks = tables.shape[1]
        splits = cpu_paged.splits_for(rows, blocks, threads)
        scale = float(attn.scale)
        window = meta.sliding_window or 0
        num_slots = views.flat[0].shape[1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.float32)

        other, normed = buffer(rows, hidden), buffer(rows, hidden)
        qkv = buffer(rows, (hq + 2 * hkv) * d)
        heads = qkv.view(rows, hq + 2 * hkv, d)
        q_src, k_src, v_src = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
        q, k, out = buffer(rows, hq, d), buffer(rows, hkv, d), buffer(rows, hq, d)
        o, down = buffer(rows, hidden), buffer(rows, hidden)
        gate_up, act = buffer(rows, 2 * self.inner), buffer(rows, self.inner)
        bad = torch.zeros(1, dtype=torch.long)
        ld_qkv, ld_gate_up = qkv.stride(0), gate_up.stride(0)

        norm(x, x, x, self.first_norm, normed, rows, hidden, 0, self.first_eps, width, threads)
        for i, layer in enumerate(self.layers):  # each call as the modules make it (module docstring)
            layer.qkv(normed, qkv, rows, threads)
            rotary(q_src, cos, sin, q, rows, ld_qkv, hq, d, threads)
            rotary(k_src, cos, sin, k, rows, ld_qkv, hkv, d, threads)
            kv_write(views.flat[i], slots, k, v_src, bad, rows, hkv * d, num_slots, k.stride(0), ld_qkv)
            views.paged_kernel(
                q,
                views.keys[i],
                views.values[i],
                tables,
                firsts,
                lens,
                out,
                rows,
                blocks,
                tables.stride(0),
                window,
                splits,
                threads,
                scale,
            )
            layer.o(out, o, rows, threads)
            norm(x, o, other, layer.post_norm, normed, rows, hidden, 1, layer.post_eps, width, threads)
            x, other = other, x
            layer.gate_up(normed, gate_up, rows, threads)
            swiglu(gate_up, act, rows, self.inner, ld_gate_up)
            layer.down(act, down, rows, threads)
            norm(x, down, other, layer.next_norm, normed, rows, hidden, 1, layer.next_eps, width, threads)
            x, other = other, x
        cpu_fused.check_slots(bad, slots, num_slots)
        return normed


def _static_problem(model: LlamaForCausalLM) -> str | None:
    """Why ``model``'s decode steps cannot run as ``LeanDecode`` whatever the step, or None."""
    cfg = model.config
    if model.tp.world_size != 1:
        return "tensor parallel"
    if cfg.qk_norm:
        return "q/k norms"
    if cfg.hidden_size < cpu_fused.NORM_MIN:
        return f"hidden size {cfg.hidden_size} below the fused norm's {cpu_fused.NORM_MIN}"
    if model.model.embed_tokens.weight.dtype != torch.float32 or model.model.embed_tokens.weight.device.type != "cpu":
        return "not a CPU fp32 model"
    if cpu_fused.norm_width() is None:
        return "no fused norm here"
    if not (cpu_fused.rotary_usable() and cpu_fused.kv_write_usable() and cpu_fused.swiglu_usable()):
        return "a fused kernel is not usable here"
    return None


def _layers(model: LlamaForCausalLM) -> tuple[list[_Layer], list[Any]] | None:
    """Each decoder layer's kernels and weights, and the packed linears they come from; None
    where a linear has no panel copy."""
    decoder: list[DecoderLayer] = list(model.model.layers)  # type: ignore[arg-type]
    nexts: list[RMSNorm] = [layer.input_layernorm for layer in decoder[1:]] + [model.model.norm]
    layers, packed = [], []
    for layer, after in zip(decoder, nexts, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.fused is None or mlp.fused is None:
            return None
        sources = [attn.fused, attn.o_proj.impl, mlp.fused, mlp.down_proj.impl]
        packed.extend(sources)
        units = [_Linear.of(u) for u in sources]
        if any(u is None for u in units):
            return None
        qkv, o, gate_up, down = units
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        post = layer.post_attention_layernorm
        layers.append(_Layer(qkv, o, gate_up, down, post.weight, float(post.eps), after.weight, float(after.eps)))
    return layers, packed
