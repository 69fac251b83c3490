"""Tiny random Hugging Face models for tests and benchmarks, made offline in seconds.

`make_tiny_model` writes a directory that `transformers.AutoModelForCausalLM` and
`AutoTokenizer` load as they would a real checkpoint: config.json (written by transformers'
own config class, so it has the installed version's format), seeded random weights in
safetensors under the exact HF parameter names (sharded with an index when asked),
generation_config.json, and a byte-level BPE tokenizer trained on the corpus shipped in
`corpus/` with a Llama-3 style chat template.

Weights come straight from seeded torch generators, one per tensor (seed derived from the
model seed and the tensor name), never from instantiating the HF model: a ~100M-parameter
model is written in seconds, and the same seed gives byte-identical files.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.models.gguf import MARKER

ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: special tokens take ids 0..5, the 256 byte symbols come next.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
    PAD_TOKEN,
)
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

_CORPUS_DIR = Path(__file__).parent / "corpus"
# Output-layer std in units of 1/sqrt(hidden): final-norm output has unit RMS, so logits get
# std ~ this value, wide enough that greedy top-1/top-2 gaps are rarely near fp32 noise.
_LM_HEAD_SCALE = 1.0
_MATRIX_STD = 0.02  # q/k/v projections and the untied embedding
_ATTN_GAIN = 1.5
_MLP_GAIN = 16.0


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None  # None: max_position_embeddings // factor

    def as_dict(self, max_position_embeddings: int) -> dict[str, Any]:
        original = self.original_max_position_embeddings
        if original is None:
            original = max(1, int(max_position_embeddings // self.factor))
        return {
            "rope_type": "llama3",
            "factor": float(self.factor),
            "low_freq_factor": float(self.low_freq_factor),
            "high_freq_factor": float(self.high_freq_factor),
            "original_max_position_embeddings": int(original),
        }


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int | None = None  # None: 2 * hidden_size
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    seed: int = 0
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    sliding_window: int | None = None
    max_shard_size: int | None = None  # bytes; None: one model.safetensors
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} is not supported: use one of {', '.join(ARCHS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}: pick kv heads that divide the query heads"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads "
                f"{self.num_heads}: pass head_dim explicitly or change the sizes"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim {self.resolved_head_dim} must be even for rotary embeddings")
        if self.arch == "qwen2" and self.resolved_head_dim * self.num_heads != self.hidden_size:
            raise ValueError("qwen2 configs have no head_dim field: head_dim must equal hidden_size // num_heads")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size {self.vocab_size} is too small: the byte-level tokenizer "
                f"needs at least {MIN_VOCAB_SIZE} (256 bytes + special tokens)"
            )
        if self.sliding_window is not None and self.arch not in ("mistral", "qwen2", "qwen3"):
            raise ValueError(f"sliding_window is not supported for {self.arch}: use mistral, qwen2 or qwen3")
        if self.rope_scaling is not None:
            original = self.rope_scaling.as_dict(self.max_position_embeddings)["original_max_position_embeddings"]
            if original >= self.max_position_embeddings:
                raise ValueError(
                    f"llama3 rope scaling: original_max_position_embeddings {original} "
                    f"must be below max_position_embeddings {self.max_position_embeddings}"
                )
        if self.max_shard_size is not None and self.max_shard_size < 1:
            raise ValueError(f"max_shard_size must be a positive byte count, got {self.max_shard_size}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def resolved_intermediate_size(self) -> int:
        return self.intermediate_size or 2 * self.hidden_size

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF parameter names -> shapes, in checkpoint order (tied lm_head left out)."""
        h, d, inter = self.hidden_size, self.resolved_head_dim, self.resolved_intermediate_size
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
            if self.arch == "qwen2":
                shapes[p + "self_attn.q_proj.bias"] = (q_out,)
                shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
                shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
            if self.arch == "qwen3":
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @property
    def lm_head_std(self) -> float:
        return _LM_HEAD_SCALE / math.sqrt(self.hidden_size)

    @property
    def embedding_std(self) -> float:
        return self.lm_head_std if self.tie_word_embeddings else _MATRIX_STD

    # Residual-stream budget, in units of the embedding std. Greedy decoding stays varied when
    # each step's output is driven by token-dependent random maps (the embedding itself, and the
    # MLPs) while attention adds context at about the embedding's scale: when attention
    # dominates, decoding falls into a fixed point and repeats one token.
    @property
    def attn_out_std(self) -> float:
        # Attention output ~ (_MATRIX_STD * sqrt(hidden)) * std * sqrt(num_heads * head_dim).
        v_rms = _MATRIX_STD * math.sqrt(self.hidden_size)
        q_out = self.num_heads * self.resolved_head_dim
        return _ATTN_GAIN * self.embedding_std / (v_rms * math.sqrt(q_out))

    @property
    def mlp_out_std(self) -> float:
        # silu(gate) * up has RMS ~0.5 with unit-scale gate/up; the layers' outputs add up
        # like a random walk, hence the sqrt(num_layers).
        per_layer = _MLP_GAIN * self.embedding_std / math.sqrt(self.num_layers)
        return per_layer / (0.5 * math.sqrt(self.resolved_intermediate_size))

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.parameter_shapes().values())


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: str | Mapping[str, Any] | Llama3RopeScaling | None = None,
    sliding_window: int | None = None,
    max_shard_size: int | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random model directory; `rope_scaling` is None, "llama3" (defaults), a
    Llama3RopeScaling, or a mapping of its fields. Returns the directory."""
    spec = TinyModelSpec(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        rope_scaling=_parse_rope_scaling(rope_scaling),
        sliding_window=sliding_window,
        max_shard_size=max_shard_size,
        dtype=dtype,
    )
    return write_tiny_model(spec, out_dir)


def write_tiny_model(spec: TinyModelSpec, out_dir: str | Path) -> Path:
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()  # a previous run with another shard count must not leave extra files
    tokenizer = _save_tokenizer(spec.vocab_size, out)
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(EOT_TOKEN)]
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    _build_config(spec, bos_id, eos_ids, pad_id).save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id).save_pretrained(out)
    _save_weights(spec, out)
    marker = {"weights": "random", "made_by": "pdserve tiny-model", "arch": spec.arch, "seed": spec.seed}
    (out / MARKER).write_text(json.dumps(marker) + "\n")  # banners say these weights are noise
    return out


def tokenizer_vocab_size(vocab_size: int) -> int:
    """Size of the tokenizer trained for a model of `vocab_size` (<= vocab_size)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size)).get_vocab_size()


def _parse_rope_scaling(value: str | Mapping[str, Any] | Llama3RopeScaling | None) -> Llama3RopeScaling | None:
    if value is None or isinstance(value, Llama3RopeScaling):
        return value
    if value == "llama3":
        return Llama3RopeScaling()
    if isinstance(value, Mapping):
        fields = dict(value)
        if fields.pop("rope_type", fields.pop("type", "llama3")) != "llama3":
            raise ValueError(f"rope scaling {value!r} is not supported: only rope_type 'llama3'")
        return Llama3RopeScaling(**fields)
    raise ValueError(f"rope scaling {value!r} is not supported: use None, 'llama3' or a mapping")


def _build_config(spec: TinyModelSpec, bos_id: int, eos_ids: list[int], pad_id: int):
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[spec.arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.resolved_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        architectures=[_ARCH_CLASSES[spec.arch]],
    )
    if spec.arch != "qwen2":
        kwargs["head_dim"] = spec.resolved_head_dim
    if spec.arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = spec.sliding_window is not None
        # HF and vLLM slide the window only in layers with index >= max_window_layers.
        kwargs["max_window_layers"] = 0 if spec.sliding_window is not None else spec.num_layers
    if spec.arch in ("mistral", "qwen2", "qwen3"):
        kwargs["sliding_window"] = spec.sliding_window
    rope_scaling = spec.rope_scaling.as_dict(spec.max_position_embeddings) if spec.rope_scaling is not None else None
    if "rope_parameters" in inspect.signature(config_cls).parameters:
        # transformers >= 5: theta and scaling live together in "rope_parameters".
        kwargs["rope_parameters"] = {"rope_theta": float(spec.rope_theta), **(rope_scaling or {"rope_type": "default"})}
        kwargs["dtype"] = spec.dtype
    else:  # transformers 4.x: top-level "rope_theta" and "rope_scaling".
        kwargs["rope_theta"] = float(spec.rope_theta)
        kwargs["rope_scaling"] = rope_scaling
        kwargs["torch_dtype"] = spec.dtype
    return config_cls(**kwargs)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_tensor(spec: TinyModelSpec, name: str, shape: tuple[int, ...]):
    import torch

    if name.endswith("norm.weight"):  # all RMSNorm weights, q_norm/k_norm included
        return torch.ones(shape, dtype=torch.float32)
    if name == "lm_head.weight":
        std = spec.lm_head_std
    elif name == "model.embed_tokens.weight":
        std = spec.embedding_std
    elif name.endswith(("gate_proj.weight", "up_proj.weight")):
        std = 1.0 / math.sqrt(spec.hidden_size)
    elif name.endswith("down_proj.weight"):
        std = spec.mlp_out_std
    elif name.endswith("o_proj.weight"):
        std = spec.attn_out_std
    else:
        std = _MATRIX_STD
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(spec.seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def _save_weights(spec: TinyModelSpec, out: Path) -> None:
    import torch

    dtype = getattr(torch, spec.dtype)
    shards: list[dict[str, Any]] = [{}]
    shard_bytes = 0
    for name, shape in spec.parameter_shapes().items():
        tensor = _init_tensor(spec, name, shape).to(dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if spec.max_shard_size is not None and shards[-1] and shard_bytes + size > spec.max_shard_size:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    if spec.max_shard_size is None:
        _save_shard(shards[0], out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    total_size = 0
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(shard, out / filename)
        for name, tensor in shard.items():
            weight_map[name] = filename
            total_size += tensor.numel() * tensor.element_size()
    index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")


def _save_shard(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates the file 0600; other local users may serve it


@functools.cache
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Byte-level BPE trained on the shipped corpus; deterministic, cached per vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [path.read_text(encoding="utf-8") for path in sorted(_CORPUS_DIR.glob("*.txt"))]
    lines = [line for text in corpus for line in text.splitlines(keepends=True)]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama 3: plain encode() prepends BOS; chat templates write it themselves.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


def _save_tokenizer(vocab_size: int, out: Path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        bos_token=BOS_TOKEN,
        eos_token=EOT_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)
    return tokenizer
