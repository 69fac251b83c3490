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

from workers.backends.base import Ops
from workers.models.config import ModelConfig, RopeConfig
from workers.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from workers.backends.base import FastDecode, FusedLinear
    from workers.layers.paged_attention import PagedAttention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``: the decoder's residual add and the norm after it."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


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


class Attention(nn.Module):
    # q/k/v read the same input: a backend may multiply them as one (``fused``)
    fused_inputs = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, ops: Ops) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops
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
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ops)
        self.fused: FusedLinear | None = None

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
        cos, sin = rope
        if heads is not None and not self.qk_norm:
            # one rotation for q's and k's adjacent heads: the same elementwise arithmetic, half the ops
            q, k = self.ops.rotary(heads[:, : hq + hkv], cos, sin).split([hq, hkv], dim=1)
        else:
            q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        o = attn.forward(self.layer, q, k, v)
        return self.o_proj(o.reshape(tokens, -1))


class MLP(nn.Module):
    fused_inputs = ("gate_proj", "up_proj")  # a backend may multiply them as one (``fused``)

    def __init__(self, cfg: ModelConfig, tp: TPGroup, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, inner, cfg.mlp_bias, tp)
        self.up_proj = ColumnParallelLinear(hidden, inner, cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(inner, hidden, cfg.mlp_bias, tp)
        self.fused: FusedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.applies(x):
            return self.down_proj(self.ops.swiglu(self.fused(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, ops: Ops) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp, ops)
        self.mlp = MLP(cfg, tp, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: PagedAttention,
        norm_after: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + attn(norm(x))``, then ``+ mlp(norm(...))``, given ``normed = input_layernorm(x)``;
        returns the new residual stream and ``norm_after`` of it (the next layer's input norm,
        or the final norm after the last), so each residual add joins the norm after it."""
        x, normed = self.post_attention_layernorm.add_forward(x, self.self_attn(normed, rope, attn))
        return norm_after.add_forward(x, self.mlp(normed))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)


class LlamaForCausalLM(nn.Module):
    """One class for the whole family; the config switches qkv bias, q/k norm and tying.
    ``tp``: this rank's shard of a tensor-parallel model (default: the whole model); ``ops``:
    the backend's elementwise ops (default: the reference's)."""

    # A backend's whole-step decode path, where it has one (set by load_model)
    fast_decode: FastDecode | None = None

    def __init__(
        self, cfg: ModelConfig, max_positions: int | None = None, tp: TPGroup | None = None, ops: Ops | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup()
        self.ops = ops or Ops()
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, self.tp, self.ops)
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)

    @property
    def attention_scale(self) -> float:
        return self.config.head_dim**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        fast = self.fast_decode
        if fast is not None and not torch.compiler.is_compiling() and fast.takes(input_ids, attn):
            return fast.run(input_ids, positions, attn)  # the same result, without the modules
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb.tables(positions, x.dtype)
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        norms_after = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        normed = layers[0].input_layernorm(x)
        for layer, after in zip(layers, norms_after, strict=True):
            x, normed = layer(x, normed, rope, attn, after)
        return normed

    @property
    def head(self) -> VocabParallelEmbedding:
        """What scores hidden states: the embedding when tied, else ``lm_head``."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden).float()
