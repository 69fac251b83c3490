"""The model facts the engine needs, read from a Hugging Face ``config.json``.

Both config dialects are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). Nothing here imports transformers: a worker can size its KV cache and a
planner can do arithmetic without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + embed + h

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a Hugging Face model directory")
        raw = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        generation = generation or {}
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or raw.get('model_type')!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r}: only 'silu' is supported")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        sliding_window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            sliding_window = None
        layer_types = set(raw.get("layer_types") or ())
        if sliding_window and len(layer_types) > 1:
            # e.g. Qwen2 with 0 < max_window_layers < num_hidden_layers: a window on some layers only.
            raise UnsupportedModelError(
                f"layer_types mixes {sorted(layer_types)}: a sliding window on some layers only is not supported"
            )
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=_parse_rope(raw),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=family == "qwen2" or raw.get("attention_bias", False),
            o_bias=family != "qwen2" and raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=family == "qwen3",
            sliding_window=sliding_window,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )


def _parse_rope(raw: dict) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4.x layout
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type layout: every layer here is full
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )
