"""CPU fp32 decode steps as one loop of kernel calls (``workers/backends/cpu/lean_decode.py``) give the
module path's hidden states bit for bit, run only where every call is the module path's, and
refuse a KV slot out of range as the module path does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.backends.cpu import fused as cpu_fused

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or cpu_fused.norm_width() is None,
    reason="the fused kernels the lean path calls do not run on this CPU",
)


def _engine(model_dir: str, **kwargs):
    from workers.engine import LLMEngine

    kwargs.setdefault("plain_linear_rows", 8)
    return LLMEngine(model_dir, load_progress=False, num_kv_blocks=64, **kwargs)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 70, (n,), generator=gen).tolist()
    return [torch.randint(5, 250, (length,), generator=gen).tolist() for length in lengths]


class _BothPaths:
    """Wraps a model's ``LeanDecode.run``: each step it takes also runs through the modules (the
    same K/V written to the same slots again) and the two hidden states are compared."""

    def __init__(self, model, monkeypatch) -> None:
        self.model, self.lean = model, model.fast_decode
        self.steps, self.equal, self.rows = 0, 0, set()
        monkeypatch.setattr(self.lean, "run", self.run)
        self._run = type(self.lean).run

    def run(self, input_ids, positions, attn):
        lean_out = self._run(self.lean, input_ids, positions, attn)
        self.model.fast_decode = None
        try:
            module_out = self.model(input_ids, positions, attn)
        finally:
            self.model.fast_decode = self.lean
        self.steps += 1
        self.equal += torch.equal(lean_out, module_out)
        self.rows.add(input_ids.shape[0])
        return lean_out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # plain; q/k/v biases; a sliding window
def test_lean_decode_steps_equal_the_module_path_bit_for_bit(tiny_model_dirs, arch, monkeypatch):
    from workers.engine import SamplingParams

    engine = _engine(tiny_model_dirs[arch])
    assert engine.model.fast_decode is not None
    both = _BothPaths(engine.model, monkeypatch)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for batch in (1, 3, 8):
        engine.generate(_prompts(batch, seed=batch), params)
    assert both.steps > 20 and both.equal == both.steps, (both.steps, both.equal)
    assert {1, 3, 8} <= both.rows, both.rows


def test_greedy_tokens_and_logprobs_are_the_same_with_the_lean_path_on_or_off(tiny_llama):
    from workers.engine import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = _prompts(5, seed=7)
    runs = []
    for on in (True, False):  # an engine each: the second would find the prompts' blocks in its prefix cache
        engine = _engine(tiny_llama, lean_decode=on)
        assert (engine.model.fast_decode is not None) == on
        outs = engine.generate(prompts, params)
        runs.append([(o.token_ids, o.logprobs) for o in outs])
    assert runs[0] == runs[1]


def test_it_runs_only_decode_steps_the_panel_kernel_takes(tiny_model_dirs, monkeypatch):
    from workers.engine import SamplingParams

    engine = _engine(tiny_model_dirs["llama"])
    lean = engine.model.fast_decode
    taken: list[int] = []
    run = type(lean).run

    def counted(input_ids, positions, attn):
        taken.append(input_ids.shape[0])
        return run(lean, input_ids, positions, attn)

    monkeypatch.setattr(lean, "run", counted)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(_prompts(12, seed=3), params)  # 12 decodes a step: wider than the panel kernel's 8
    assert taken == []
    engine.generate(_prompts(8, seed=2), params)
    assert taken and set(taken) == {8} and lean.max_rows == 8, taken
    # aten's ops everywhere: no fused kernel, so no lean path either
    assert _engine(tiny_model_dirs["llama"], fused_ops=False).model.fast_decode is None


def test_no_lean_path_where_a_call_would_differ(tiny_model_dirs):
    """q/k norms (qwen3), every batch on oneDNN or AMX (no panel kernel rows), a quantized cache,
    the sdpa backend: the modules."""
    assert _engine(tiny_model_dirs["qwen3"]).model.fast_decode is None
    assert _engine(tiny_model_dirs["llama"], plain_linear_rows=0).model.fast_decode is None
    quantized = _engine(tiny_model_dirs["llama"], kv_cache_dtype="int8", attention_backend="sdpa")
    sdpa = _engine(tiny_model_dirs["llama"], attention_backend="sdpa")
    from workers.engine import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for engine in (quantized, sdpa):
        lean = engine.model.fast_decode
        assert lean is not None  # the model could; the step's attention or cache cannot
        calls: list[bool] = []
        original = lean.takes

        def takes(input_ids, attn, _original=original, _calls=calls):
            _calls.append(_original(input_ids, attn))
            return _calls[-1]

        lean.takes = takes
        engine.generate(_prompts(2, seed=5), params)
        assert calls and not any(calls)


def test_a_kv_slot_out_of_range_raises_index_error(tiny_llama, monkeypatch):
    from workers.engine import SamplingParams

    engine = _engine(tiny_llama)
    lean = engine.model.fast_decode
    seen = []
    run = type(lean).run

    def keep(input_ids, positions, attn):
        seen.append((input_ids, positions, attn))
        return run(lean, input_ids, positions, attn)

    monkeypatch.setattr(lean, "run", keep)
    engine.generate(_prompts(2, seed=6), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    input_ids, positions, attn = seen[-1]
    write = attn.meta.write
    num_slots = attn.kv.flat(0).shape[1]
    bad = write.slots.clone()
    bad[-1] = num_slots
    attn.meta.write = dataclasses.replace(write, slots=bad)
    with torch.inference_mode(), pytest.raises(IndexError, match="out of range"):  # as steps run
        run(lean, input_ids, positions, attn)
