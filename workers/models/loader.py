"""Load a Hugging Face model directory into ``LlamaForCausalLM``.

Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json`` (or every
``*.safetensors`` in the directory), tensor by tensor, straight into the parameters on the target
device, with a progress bar. Missing or unexpected weights fail the load with their names.

A tensor-parallel rank reads only its slice of each sharded weight (``get_slice``: the file is
memory-mapped and only the slice's bytes are read), never the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from workers.models.config import ModelConfig
from workers.models.llama import LlamaForCausalLM
from workers.models.parallel import Shard, TPGroup

if TYPE_CHECKING:
    from workers.backends.base import Backend

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(cfg: ModelConfig, device: torch.device, dtype: str | None) -> torch.dtype:
    """fp32 on CPU; on CUDA the checkpoint's half type (bf16 when it says fp32 or nothing)."""
    if dtype not in (None, "auto"):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if cfg.torch_dtype == "float16" else torch.bfloat16


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _fill_random(model: LlamaForCausalLM, rank: int) -> None:
    """Norms 1, everything else N(0, 0.02), seeded per rank: activations stay in range."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(1234 + rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | None = None,
    tp: TPGroup | None = None,
    backend: Backend | None = None,
    *,
    max_positions: int | None = None,
    progress: bool = True,
    random_weights: bool = False,
) -> LlamaForCausalLM:
    """The model (``tp``: this rank's shard of it) with its weights from ``model_dir``, computing
    through ``backend`` (its ops, its prepared linears, its fast decode path; None: the reference's
    plain torch). ``random_weights``: seeded random weights of the config's shapes instead, no file
    read (``config.json`` is all ``model_dir`` needs)."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(cfg, device, dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp, backend.ops if backend is not None else None)
    model = model.to(torch_dtype).to_empty(device=device)
    model.model.rotary_emb.build(device)  # fp32 tables, computed for real on the device

    if random_weights:
        _fill_random(model, tp.rank if tp is not None else 0)
        logger.info(
            "%s: random weights (%.1fM params) on %s as %s", model_dir.name, cfg.num_params / 1e6, device, torch_dtype
        )
        if backend is not None:
            backend.prepare_model(model, torch_dtype)
            model.fast_decode = backend.fast_decode(model)
        return model.eval()

    params = dict(model.named_parameters())
    shards: dict[str, Shard] = {
        f"{prefix}.{name}" if prefix else name: shard
        for prefix, module in model.named_modules()
        for name, shard in getattr(module, "shards", {}).items()
    }
    loaded: set[str] = set()
    unexpected: list[str] = []
    files = weight_files(model_dir)
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(list(f.keys()))
    # Off a terminal (a Ray replica's output is forwarded line by line) a bar shows only for a load
    # that takes more than a few seconds, and then at most one line per 15 s.
    quiet = {} if sys.stderr.isatty() else {"delay": 5.0, "mininterval": 15.0}
    progress = progress and (tp is None or tp.rank == 0)  # one bar for a tensor-parallel load
    bar = tqdm(total=total, desc=f"Loading {model_dir.name}", unit="tensor", disable=not progress, **quiet)
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    bar.update(1)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if cfg.tie_word_embeddings and name == "lm_head.weight":
                        continue  # tied: the embedding serves as the head
                    param = params.get(name)
                    if param is None:
                        unexpected.append(name)
                        continue
                    shard = shards.get(name)
                    stored = f.get_slice(name)
                    shape = tuple(stored.get_shape())
                    expected = shard.full_shape if shard else tuple(param.shape)
                    if shape != expected:
                        raise ValueError(f"{path.name}: {name} has shape {shape}, the config implies {expected}")
                    tensor = stored[shard.index] if shard else f.get_tensor(name)
                    target: torch.Tensor = param
                    if tensor.shape != param.shape:  # the last vocabulary shard: padding rows stay zero
                        param.zero_()
                        target = param[: tensor.shape[0]]
                    target.copy_(tensor.to(torch_dtype))
                    loaded.add(name)
    bar.close()
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"weights in {model_dir} do not fit {cfg.architecture}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    logger.info(
        "loaded %s (%s, %.1fM params) from %s onto %s as %s",
        model_dir.name,
        cfg.architecture,
        cfg.num_params / 1e6,
        model_dir,
        device,
        torch_dtype,
    )
    if backend is not None:
        backend.prepare_model(model, torch_dtype)
        model.fast_decode = backend.fast_decode(model)
    return model.eval()
