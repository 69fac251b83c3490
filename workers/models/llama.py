"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameter names match Hugging Face checkpoints, so weights load by name. The arithmetic follows
transformers' order of operations (RMSNorm in fp32, rotary tables in fp32, SDPA) so that greedy
decoding matches ``generate`` token for token in fp32.

With tensor parallelism (``TPGroup``, ``workers/models/parallel.py``) each rank holds its query
and KV heads and its slice of the MLP; the names stay the checkpoint's, so a rank loads its
slice of each weight by name.

Tokens arrive flattened (``[T]``, no batch dimension): a step mixes decodes and prefill chunks
of many sequences, and ``PagedAttention`` knows which rows belong to which sequence.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from workers.backends.cpu import fused as cpu_fused
from workers.layers.paged_attention import PagedAttention
from workers.models.config import ModelConfig, RopeConfig
from workers.models.parallel import (
    ColumnParallelLinear,
    FusedPackedLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from workers.backends.cpu.lean_decode import LeanDecode


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op, bit for bit transformers' arithmetic in fp32 (checked against LlamaRMSNorm in
            # tests/unit/test_engine_parity.py): eager runs two norms a layer, and each of the six
            # small ops below costs a dispatch. On CPU, cpu_fused's kernel (the first layer's
            # input norm, q/k norms; the others come with their residual add: add_forward).
            if cpu_fused.norm_takes(x, self.weight):
                return cpu_fused.add_rms_norm(x, None, self.weight, self.eps)[1]
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)  # transformers' rounding: to the input's dtype, then the weight

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``: the decoder's residual add and the norm after it,
        on CPU fp32 in one pass of ``cpu_fused``'s kernel (bit for bit ``F.rms_norm`` after the add)."""
        if cpu_fused.norm_takes(x, self.weight, residual):
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)
        h = x + residual
        return h, self(h)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32 as transformers does per step."""

    cos: torch.Tensor  # [max_positions, head_dim] buffers (build)
    sin: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.build(torch.get_default_device())

    def build(self, device: torch.device) -> None:
        """(Re)compute the tables on ``device`` in fp32 (after a model was made on meta)."""
        positions = torch.arange(self.max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * rope_inv_freq(self.rope, self.head_dim)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D]`` for ``positions``: looked up once a step, used by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    return rotate(rope, q), rotate(rope, k)


def rotate(rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[T, heads, D]`` (transformers' arithmetic; on CPU
    fp32 one pass of ``cpu_fused``'s kernel, bit for bit the same)."""
    cos, sin = rope
    if cpu_fused.rotary_takes(x, cos, sin):
        return cpu_fused.rotary(x, cos, sin)
    return cpu_fused.eager_rotary(x, cos, sin)


class Attention(nn.Module):
    # q/k/v read the same input: prepack_linears packs them as one (``fused``, CPU fp32)
    fused_inputs = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        d, hidden = cfg.head_dim, cfg.hidden_size
        kv_heads = tp.kv_heads(cfg.num_kv_heads)  # the KV heads this rank's query heads use
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp.world_size, len(kv_heads), d
        kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
        self.q_proj = ColumnParallelLinear(hidden, cfg.num_heads * d, cfg.qkv_bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, cfg.num_kv_heads * d, cfg.qkv_bias, tp, kv_rows)
        self.v_proj = ColumnParallelLinear(hidden, cfg.num_kv_heads * d, cfg.qkv_bias, tp, kv_rows)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, hidden, cfg.o_bias, tp)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # per head_dim: the same weights on every rank, applied to its heads
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fused: FusedPackedLinear | None = None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], attn: PagedAttention) -> torch.Tensor:
        tokens, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        heads = None  # the fused output: q, k and v heads side by side
        if self.fused is not None and self.fused.applies(x):
            heads = self.fused(x).view(tokens, hq + 2 * hkv, self.head_dim)
            q, k, v = heads.split([hq, hkv, hkv], dim=1)
        else:
            q = self.q_proj(x).view(tokens, hq, self.head_dim)
            k = self.k_proj(x).view(tokens, hkv, self.head_dim)
            v = self.v_proj(x).view(tokens, hkv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if heads is not None and not self.qk_norm:
            # one rotation for q's and k's adjacent heads: the same elementwise arithmetic, half the ops
            q, k = rotate(rope, heads[:, : hq + hkv]).split([hq, hkv], dim=1)
        else:
            q, k = apply_rotary(rope, q, k)
        o = attn.forward(self.layer, q, k, v)
        return self.o_proj(o.reshape(tokens, -1))


class MLP(nn.Module):
    fused_inputs = ("gate_proj", "up_proj")  # packed as one by prepack_linears (CPU fp32)

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, inner, cfg.mlp_bias, tp)
        self.up_proj = ColumnParallelLinear(hidden, inner, cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(inner, hidden, cfg.mlp_bias, tp)
        self.fused: FusedPackedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.applies(x):
            gate_up = self.fused(x)
            if cpu_fused.swiglu_takes(gate_up):  # CPU fp32, a few rows: one call, aten's bits
                return self.down_proj(cpu_fused.swiglu(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # No forward of its own: LlamaForCausalLM.forward runs x + attn(norm(x)), then
        # x + mlp(norm(x)), joining each residual add to the norm that follows it.


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)


class LlamaForCausalLM(nn.Module):
    """One class for the whole family; the config switches qkv bias, q/k norm and tying.
    ``tp``: this rank's shard of a tensor-parallel model (default: the whole model)."""

    # Batches of up to this many rows multiply with F.linear though the linears are packed
    # (prepack_linears, choose_plain_rows: set by load_model)
    plain_linear_rows = 0
    # CPU fp32 decode steps as one loop of kernel calls (workers/backends/cpu/lean_decode.py; set by
    # load_model where it applies)
    lean_decode: LeanDecode | None = None

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup()
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, self.tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)

    @property
    def attention_scale(self) -> float:
        return self.config.head_dim**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        lean = self.lean_decode
        if lean is not None and not torch.compiler.is_compiling() and lean.takes(input_ids, attn):
            return lean.run(input_ids, positions, attn)  # the same calls, bit for bit, without the modules
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb.tables(positions, x.dtype)
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        # each layer: x + attn(norm(x)), then x + mlp(norm(x)), with each residual add joined to
        # the norm after it (the next layer's input norm; the final norm after the last): one
        # kernel call each on CPU fp32 (RMSNorm.add_forward)
        norms_after = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        normed = layers[0].input_layernorm(x)
        for layer, after in zip(layers, norms_after, strict=True):
            x, normed = layer.post_attention_layernorm.add_forward(x, layer.self_attn(normed, rope, attn))
            x, normed = after.add_forward(x, layer.mlp(normed))
        return normed

    @property
    def head(self) -> VocabParallelEmbedding:
        """What scores hidden states: the embedding when tied, else ``lm_head``."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden).float()
