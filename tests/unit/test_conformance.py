"""The backend boundary: which backend an engine gets, and every backend against the reference.

The reference backend (plain torch, gather + SDPA) is the specification. The CPU backend's
elementwise kernels claim aten's bits, so with the same linears (``prepack_weights=False``:
``F.linear``) and the same attention (``sdpa``) its engine must give the reference engine's
logits bit for bit; with everything on, greedy tokens equal transformers' (test_engine_parity.py
runs its whole suite on each backend).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine_helpers import random_prompts
from workers import backends
from workers.backends.base import Ops
from workers.backends.cpu.backend import CPUOps
from workers.engine import EngineConfig, LLMEngine, SamplingParams


def _engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(model_dir, load_progress=False, num_kv_blocks=128, **kwargs)


def test_auto_is_the_devices_own_and_reference_runs_anywhere(tiny_llama, monkeypatch):
    monkeypatch.delenv(backends.FORCE_ENV, raising=False)
    cpu = torch.device("cpu")
    assert backends.resolve("auto", cpu) == "cpu"
    assert backends.resolve("reference", cpu) == "reference"
    with pytest.raises(ValueError, match="backend='cuda' runs on a cuda device"):
        backends.resolve("cuda", cpu)
    with pytest.raises(ValueError, match="backend='tpu': choose one of"):
        backends.resolve("tpu", cpu)
    monkeypatch.setenv(backends.FORCE_ENV, "reference")
    assert backends.resolve("auto", cpu) == "reference"
    assert backends.resolve("cpu", cpu) == "cpu"  # an explicit choice stands
    with pytest.raises(ValueError, match="backend='tpu'"):
        EngineConfig(model_dir=tiny_llama, backend="tpu")


def test_each_backend_offers_its_attention_kinds(tiny_llama, monkeypatch):
    monkeypatch.delenv(backends.FORCE_ENV, raising=False)
    reference = _engine(tiny_llama, backend="reference")
    cpu = _engine(tiny_llama)
    assert (reference.backend.name, reference.runner.attention_backend) == ("reference", "sdpa")
    assert (cpu.backend.name, cpu.runner.attention_backend) == ("cpu", "paged")
    assert type(reference.backend.ops) is Ops and type(cpu.backend.ops) is CPUOps
    assert reference.model.fast_decode is None
    with pytest.raises(ValueError, match="attention_backend='paged' is not offered by the reference backend"):
        _engine(tiny_llama, backend="reference", attention_backend="paged")


def test_the_backend_is_logged_once(tiny_llama, caplog):
    with caplog.at_level("INFO", logger="workers.engine.assemble"):
        _engine(tiny_llama, backend="reference")
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.engine.assemble"]
    assert lines == ["reference backend on cpu (plain torch, gather + SDPA)"], lines


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_cpu_ops_equal_the_reference_bit_for_bit(tiny_model_dirs, arch):
    """Each elementwise op of the CPU backend on the model's shapes, against the reference's."""
    from workers.models.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_model_dirs[arch])
    gen = torch.Generator().manual_seed(1)
    cpu, ref = CPUOps(), Ops()
    for rows in (1, 3, 8, 70):
        x = torch.randn(rows, cfg.hidden_size, generator=gen) * 3
        residual = torch.randn(rows, cfg.hidden_size, generator=gen)
        weight = torch.randn(cfg.hidden_size, generator=gen)
        assert torch.equal(cpu.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
        for a, b in zip(cpu.add_rms_norm(x, residual, weight, 1e-6), ref.add_rms_norm(x, residual, weight, 1e-6)):
            assert torch.equal(a, b)
        heads = torch.randn(rows, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, generator=gen)
        angles = torch.rand(rows, 1, cfg.head_dim, generator=gen) * 50
        assert torch.equal(cpu.rotary(heads, angles.cos(), angles.sin()), ref.rotary(heads, angles.cos(), angles.sin()))
        gate_up = torch.randn(rows, 2 * cfg.intermediate_size, generator=gen) * 4
        assert torch.equal(cpu.swiglu(gate_up), ref.swiglu(gate_up))
        logits = torch.randn(rows, cfg.vocab_size, generator=gen)
        logits[:, 7] = logits.max()  # ties: the first index wins on both
        assert torch.equal(cpu.argmax(logits), ref.argmax(logits))
        slots = torch.randperm(64, generator=gen)[: min(rows, 64)]
        k = torch.randn(len(slots), cfg.num_kv_heads, cfg.head_dim, generator=gen)
        v = torch.randn(len(slots), cfg.num_kv_heads, cfg.head_dim, generator=gen)
        flat_cpu, flat_ref = (torch.zeros(2, 64, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
        cpu.kv_write(flat_cpu, slots, k, v)
        ref.kv_write(flat_ref, slots, k, v)
        assert torch.equal(flat_cpu, flat_ref)


def test_the_cpu_token_bitmask_equals_the_reference():
    """Structured outputs' mask (one bit a token, int32 words): the CPU kernel skips the words
    that allow everything and writes runs where they allow nothing; the result is the
    reference's, with rows left out untouched and padding past the vocabulary masked."""
    cpu, ref = CPUOps(), Ops()
    gen = torch.Generator().manual_seed(3)
    for vocab, width in ((49152, 49152), (1000, 1024), (37, 37)):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=gen)
        bitmask[1] = -1  # every token allowed
        bitmask[2] = 0  # none
        bitmask[3, : words // 2] = 0
        for rows in ([0, 1, 2, 3, 4, 5], [2, 4], [5]):
            logits = torch.randn(6, width, generator=gen)
            mine, theirs = logits.clone(), logits.clone()
            cpu.apply_token_bitmask(mine, bitmask, rows, vocab)
            ref.apply_token_bitmask(theirs, bitmask, rows, vocab)
            assert torch.equal(mine, theirs)
            untouched = [r for r in range(6) if r not in rows]
            assert torch.equal(mine[untouched], logits[untouched])
            allowed = (mine[rows, :vocab] > float("-inf")).sum().item()
            bits = sum(bin(w & 0xFFFFFFFF).count("1") for r in rows for w in bitmask[r].tolist())
            assert allowed == bits - sum(  # bits set past the vocabulary in the last word
                bin((bitmask[r, -1].item() & 0xFFFFFFFF) >> (vocab - 32 * (words - 1))).count("1") for r in rows
            )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_cpu_engine_gives_the_reference_engines_logprobs_bit_for_bit(tiny_model_dirs, arch):
    """The same linears and attention, the CPU backend's ops: prompt and decode logprobs equal
    the reference engine's exactly (prefix hits and chunked prompts included)."""
    model_dir = tiny_model_dirs[arch]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=4, prompt_logprobs=3, ignore_eos=True)
    prompts = random_prompts((5, 40, 77), seed=3)
    prompts.append(prompts[1] + [9, 10, 11])  # a prefix hit: a chunk after cached context
    outputs = []
    for backend in ("reference", "cpu"):
        engine = _engine(
            model_dir, backend=backend, attention_backend="sdpa", prepack_weights=False, max_num_batched_tokens=48
        )
        outs = engine.generate(prompts, params)
        outputs.append([(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs])
        engine.check_idle()
    assert outputs[0] == outputs[1]
