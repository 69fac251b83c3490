"""``load_format="dummy"``: an engine from a model directory's config alone, random weights of
its shapes (benchmarks and device checks of large shapes), and the memory plan it sizes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from workers.engine import EngineConfig, LLMEngine, SamplingParams


def test_an_engine_runs_from_the_config_alone(tiny_llama, tmp_path):
    for f in Path(tiny_llama).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    assert not list(tmp_path.glob("*.safetensors"))
    params = SamplingParams(max_tokens=6, temperature=0.0, detokenize=False)
    engine = LLMEngine(str(tmp_path), load_format="dummy", load_progress=False, kv_cache_memory_gib=0.01)
    first = engine.generate([[3, 4, 5, 6]], params)[0].token_ids
    assert len(first) == 6
    assert engine.memory_plan is not None and engine.memory_plan.num_blocks == engine.num_kv_blocks
    again = LLMEngine(str(tmp_path), load_format="dummy", load_progress=False, num_kv_blocks=16)
    assert again.generate([[3, 4, 5, 6]], params)[0].token_ids == first  # seeded: the same weights
    assert again.memory_plan is None  # the blocks were given
    engine.check_idle()


def test_an_unknown_load_format_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model_dir=tiny_llama, load_format="pickle")
