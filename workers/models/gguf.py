"""Convert a GGUF file into a Hugging Face model directory the engine loads.

The work is done by the field's libraries: the ``gguf`` package reads the file's metadata (to
refuse what we cannot serve before anything slow runs), and transformers' GGUF support builds
the config and tokenizer and dequantizes the tensors. What transformers does not do we add:

- ``save_pretrained`` refuses a GGUF-loaded model, so the dequantized state dict is written with
  ``safetensors`` (fp32: a Q4/Q8 value dequantized in fp32 is kept exactly; tied weights once);
- the config it builds has ``architectures: null``; we name the class from the GGUF architecture;
- a ``generation_config.json`` carries the GGUF's BOS/EOS/pad ids (the chat model's EOS is the
  end-of-turn token, which the engine stops on).

The directory is written beside its destination and renamed into place, under a file lock, so a
crash never leaves a half-written model and two processes converting the same file do it once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> the transformers class the engine serves (workers/models/llama.py).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MARKER = "pdserve_model.json"  # what made this directory: see describe_model()


class UnsupportedGGUFError(ValueError):
    """A GGUF file pdserve cannot serve; the message names what it holds and what is supported."""


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    architecture: str
    tensor_types: tuple[str, ...]
    num_tensors: int
    name: str | None


def _field_text(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def dequantizable_types() -> frozenset[str]:
    """GGML tensor types the installed ``gguf`` package dequantizes (plus the plain float ones)."""
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", {})
    return frozenset({"F32", "F16", "BF16", "F64"} | {t.name for t in traits})


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """Read a GGUF file's architecture and tensor types (memory-mapped; reads no weights)."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # a declared dependency; say which one if an install lost it
        raise UnsupportedGGUFError("reading GGUF files needs the `gguf` package: pip install gguf") from exc
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise UnsupportedGGUFError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = _field_text(reader, "general.architecture")
    if arch is None:
        raise UnsupportedGGUFError(f"{path} has no general.architecture field: not a model GGUF")
    types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    return GGUFInfo(
        architecture=arch, tensor_types=types, num_tensors=len(reader.tensors), name=_field_text(reader, "general.name")
    )


def check_supported(path: str | Path) -> GGUFInfo:
    info = inspect_gguf(path)
    if info.architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"{Path(path).name}: GGUF architecture {info.architecture!r} is not supported; "
            f"pdserve serves {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    unknown = sorted(set(info.tensor_types) - dequantizable_types())
    if unknown:
        raise UnsupportedGGUFError(
            f"{Path(path).name}: quantization type(s) {', '.join(unknown)} cannot be dequantized by the "
            f"installed gguf package; supported: {', '.join(sorted(dequantizable_types()))}"
        )
    return info


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_converted(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return (out / MARKER).is_file() and (out / "config.json").is_file()


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, source: dict | None = None, progress: bool = True
) -> Path:
    """Write ``out_dir`` (config.json, model.safetensors, tokenizer, chat template, generation
    config) from ``gguf_path``; return at once when it is already there."""
    gguf_path, out = Path(gguf_path).resolve(), Path(out_dir)
    if is_converted(out):
        return out
    info = check_supported(gguf_path)  # before the slow part: a clear refusal in milliseconds
    with _locked(out.parent / f".{out.name}.lock"):
        if is_converted(out):  # another process finished it while we waited
            return out
        logger.info(
            "converting %s (%s, %s) into %s", gguf_path.name, info.architecture, "/".join(info.tensor_types), out
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _write_hf_dir(gguf_path, info, tmp, progress)
            marker = {
                "weights": "converted",
                "format": "gguf",
                "gguf": gguf_path.name,
                "architecture": info.architecture,
                "tensor_types": list(info.tensor_types),
                **(source or {}),
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            if out.exists():
                shutil.rmtree(out)  # a directory without a marker is an interrupted older layout
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _write_hf_dir(gguf_path: Path, info: GGUFInfo, out: Path, progress: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    directory, name = str(gguf_path.parent), gguf_path.name
    if not progress:
        hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    config.architectures = [GGUF_ARCHITECTURES[info.architecture]]
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the engine reads embed_tokens for both
    tensors = {key: value.detach().contiguous() for key, value in state.items()}
    del model, state
    config.dtype = "float32"
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    ).save_pretrained(out)


def describe_model(model_dir: str | Path) -> str:
    """One phrase for banners: where the weights came from, and loudly when they are random."""
    marker = Path(model_dir) / MARKER
    try:
        made = json.loads(marker.read_text())
    except (OSError, ValueError):
        return "weights from the checkpoint"
    if made.get("weights") == "random":
        return "RANDOM weights (a test model made by `pdserve tiny-model`: its answers are noise)"
    if made.get("weights") == "converted":
        return f"weights converted from {made.get('gguf', 'a GGUF file')} ({'/'.join(made.get('tensor_types', []))})"
    return "weights from the checkpoint"
