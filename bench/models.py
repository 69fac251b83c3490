"""The model a benchmark runs: SmolLM2-135M-Instruct (real weights, pulled once) by default;
``--model tiny`` keeps the benchmark's own generated random model, whose shape suits a point
that real weights do not change (routing, transfer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

TINY = "tiny"
MODEL_HELP = (
    "model dir, .gguf file or 'smollm2' (default: SmolLM2-135M-Instruct); "
    "'tiny': this benchmark's generated random model"
)


def bench_model_dir(spec: str | Path | None, make_tiny: Callable[[Path], Path], tiny_path: Path) -> str:
    if spec is not None and str(spec) == TINY:
        return str(make_tiny(tiny_path))
    from workers.models.source import resolve_model

    return str(resolve_model(spec))
