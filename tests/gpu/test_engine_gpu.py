"""Engine parity on CUDA: exact in fp32; in bf16, the fraction of prompts whose greedy output
matches transformers (same dtype, same device) is reported and bounded below."""

from __future__ import annotations

import torch

from tests.unit.engine_helpers import MAX_NEW_TOKENS, random_prompts
from workers.engine import LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def hf_outputs(model_dir: str, prompts, dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                min_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def test_fp32_cuda_is_exact(tiny_model_dirs):
    for arch in ("llama", "qwen2", "qwen3"):
        model_dir = tiny_model_dirs[arch]
        prompts = random_prompts()
        engine = LLMEngine(model_dir, device="cuda", dtype="float32", num_kv_blocks=512, load_progress=False)
        outs = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == hf_outputs(model_dir, prompts, torch.float32), arch
        engine.block_manager.check_idle()


def test_bf16_cuda_match_rate(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(lengths=tuple(range(8, 300, 18)), seed=11)
    engine = LLMEngine(model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=1024, load_progress=False)
    ours = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    ref = hf_outputs(model_dir, prompts, torch.bfloat16)
    full = sum(a == b for a, b in zip(ours, ref)) / len(prompts)
    first = sum(a[0] == b[0] for a, b in zip(ours, ref)) / len(prompts)
    print(
        f"bf16 greedy parity: {full:.0%} of {len(prompts)} prompts identical over {MAX_NEW_TOKENS} tokens, "
        f"first token {first:.0%}"
    )
    assert first >= 0.9
    engine.block_manager.check_idle()


def test_quantized_kv_cache_on_cuda(tiny_model_dirs):
    """int8 and fp8 (e4m3) blocks on CUDA: agreement with the bf16 cache, reported and bounded."""
    from tests.unit.test_kv_quant import agreement, report

    model_dir = tiny_model_dirs["llama"]
    for kind in ("int8", "fp8"):
        a = agreement(model_dir, kind, device="cuda", dtype="bfloat16")
        report("llama cuda bf16", kind, a)
        assert a.tokens >= 0.5 and 0 < a.max_logit_diff < 1.0


def test_sliding_window_on_cuda_matches_transformers(tmp_path):
    from workers.models.tiny import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "swa", arch="mistral", seed=1, sliding_window=64))
    prompts = random_prompts((40, 150), seed=4)
    engine = LLMEngine(model_dir, device="cuda", dtype="float32", num_kv_blocks=64, load_progress=False)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_outputs(model_dir, prompts, torch.float32)
    engine.block_manager.check_idle()
