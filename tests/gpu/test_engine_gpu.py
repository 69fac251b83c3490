"""Engine parity on CUDA: exact in fp32; in bf16, the fraction of prompts whose greedy output
matches transformers (same dtype, same device) is reported and bounded below.

EOS ends a completion on both sides, as in the CPU parity tests. (This file first asked
transformers for ``min_new_tokens`` and the engine for ``ignore_eos``: the first masks EOS, the
second only keeps going past it, so the two parted wherever EOS was the greedy token: qwen2's
16-token prompt, on the first H200 run, 2026-12-04.) The other attention backends sum in
another order than SDPA, so there each completion must equal transformers' or part from it at a
near tie: transformers' own logits for the two tokens within ``TIE_LOGIT_GAP``.
"""

from __future__ import annotations

import torch

from tests.unit.engine_helpers import MAX_NEW_TOKENS, random_prompts
from workers.engine import LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
TIE_LOGIT_GAP = 1e-3  # fp32 rounding moves these logits by ~1e-6; a wrong cache block by far more


def hf_generate(model_dir: str, prompts, dtype: torch.dtype) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy tokens of each prompt, with its logits at every step."""
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
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            outs.append((out.sequences[0, len(p) :].tolist(), [step[0].float().cpu() for step in out.logits]))
    return outs


def hf_outputs(model_dir: str, prompts, dtype: torch.dtype) -> list[list[int]]:
    return [tokens for tokens, _ in hf_generate(model_dir, prompts, dtype)]


def test_fp32_cuda_is_exact(tiny_model_dirs):
    for arch in ("llama", "qwen2", "qwen3"):
        model_dir = tiny_model_dirs[arch]
        prompts = random_prompts()
        # the KV cache sized by the engine's memory plan (a profile step), as a replica sizes it
        engine = LLMEngine(model_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.05, load_progress=False)
        assert engine.num_kv_blocks > 0
        outs = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == hf_outputs(model_dir, prompts, torch.float32), arch
        engine.block_manager.check_idle()


def assert_parts_only_at_near_ties(label: str, prompts, ours, reference) -> int:
    """Each completion equals transformers', or first differs at a near tie (module docstring).
    Returns how many are identical."""
    identical = 0
    for prompt, mine, (ref, logits) in zip(prompts, ours, reference):
        if mine == ref:
            identical += 1
            continue
        t = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)
        gap = (logits[t][ref[t]] - logits[t][mine[t]]).item()
        assert 0 <= gap <= TIE_LOGIT_GAP, (label, len(prompt), t, mine[t], ref[t], gap)
    print(f"fp32 parity ({label}): {identical}/{len(prompts)} completions identical, the rest part at ties")
    return identical


def test_attention_backends_on_cuda(tiny_llama):
    """The paged (the hand-written Triton kernel on CUDA) and flex backends, batched, against
    transformers."""
    prompts = random_prompts()
    reference = hf_generate(tiny_llama, prompts, torch.float32)
    for backend in ("paged", "flex"):
        engine = LLMEngine(
            tiny_llama,
            device="cuda",
            dtype="float32",
            num_kv_blocks=512,
            attention_backend=backend,
            load_progress=False,
        )
        ours = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        assert_parts_only_at_near_ties(f"llama {backend}", prompts, ours, reference)
        engine.block_manager.check_idle()


def test_bf16_cuda_match_rate(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(lengths=tuple(range(8, 300, 18)), seed=11)
    engine = LLMEngine(model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.05, load_progress=False)
    ours = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    ref = hf_outputs(model_dir, prompts, torch.bfloat16)
    full = sum(a == b for a, b in zip(ours, ref)) / len(prompts)
    first = sum(a[0] == b[0] for a, b in zip(ours, ref)) / len(prompts)
    print(
        f"bf16 greedy parity: {full:.0%} of {len(prompts)} prompts identical (up to {MAX_NEW_TOKENS} tokens), "
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
