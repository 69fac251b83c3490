"""The decoder's fused CPU kernels (``workers/backends/cpu/fused.py``) equal aten's ops bit for
bit: the residual add with the RMSNorm after it, and rotary embedding; the self-checks that
guard them can fail; and an engine's logprobs are the same bits with the kernels on or off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.backends.cpu import fused as cpu_fused

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the fused norm follows aten's AVX2/AVX-512 order of sums",
)


@pytest.fixture(scope="module")
def width() -> int:
    found = cpu_fused.norm_width()
    assert found in cpu_fused.NORM_WIDTHS, "the fused norm did not match F.rms_norm at any vector width"
    return found


@pytest.mark.parametrize("n", [576, 64, 100, 1536, 2048, 4096, 4096 + 24])
@pytest.mark.parametrize("rows", [1, 8, cpu_fused.PARALLEL_ROWS - 1, cpu_fused.PARALLEL_ROWS + 3])
def test_add_rms_norm_is_the_add_then_f_rms_norm_bit_for_bit(width, n, rows):
    gen = torch.Generator().manual_seed(n * 1000 + rows)
    x = torch.randn(rows, n, generator=gen) * 4.0
    residual = torch.randn(rows, n, generator=gen) * 0.5
    weight = torch.randn(n, generator=gen)
    h, out = cpu_fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(h, x + residual)
    assert torch.equal(out, F.rms_norm(x + residual, (n,), weight, 1e-6))
    alone_h, alone = cpu_fused.add_rms_norm(x, None, weight, 1e-5)
    assert alone_h is x
    assert torch.equal(alone, F.rms_norm(x, (n,), weight, 1e-5))


def test_rows_narrower_than_the_checked_widths_keep_f_rms_norm(width):
    weight = torch.ones(cpu_fused.NORM_MIN)
    assert cpu_fused.norm_takes(torch.randn(3, cpu_fused.NORM_MIN), weight)
    assert not cpu_fused.norm_takes(torch.randn(3, 16), torch.ones(16))
    assert not cpu_fused.norm_takes(torch.randn(3, 2 * cpu_fused.NORM_MIN)[:, ::2], weight)  # strided rows
    assert not cpu_fused.norm_takes(torch.randn(3, cpu_fused.NORM_MIN, dtype=torch.bfloat16), weight)


def test_the_norm_equals_transformers_rms_norm_on_large_and_tiny_values(width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(576))
    for scale in (1e-20, 1e-3, 1.0, 1e3, 1e15):
        x = torch.randn(5, 576) * scale
        residual = torch.randn(5, 576) * scale
        _, out = cpu_fused.add_rms_norm(x, residual, ref.weight.detach(), 1e-5)
        assert torch.equal(out, ref(x + residual))


def test_the_norm_check_fails_at_the_wrong_vector_width(width):
    """The self-check is what makes the kernel safe to use: at the width aten does not sum in,
    its order differs and the check says where (so a torch that changed its order is caught)."""
    other = next(w for w in cpu_fused.NORM_WIDTHS if w != width)
    why = cpu_fused._norm_check(other)
    assert why is not None and "F.rms_norm" in why
    assert cpu_fused._norm_check(width) is None


@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("rows", [1, 9, cpu_fused.PARALLEL_ROWS + 5])
def test_rotary_is_aten_s_rotation_bit_for_bit_on_strided_heads(d, rows):
    gen = torch.Generator().manual_seed(d + rows)
    fused = torch.randn(rows, 9 + 2 * 3, d, generator=gen) * 3.0  # q, k, v heads side by side
    q_and_k = fused[:, :12]
    positions = torch.randint(0, 8192, (rows,), generator=gen).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    out = cpu_fused.rotary(q_and_k, cos, sin)
    assert out.is_contiguous()
    assert torch.equal(out, cpu_fused.eager_rotary(q_and_k, cos, sin))


def test_rotary_takes_only_what_it_can_read():
    x, cos = torch.randn(4, 3, 64), torch.randn(4, 1, 64)
    assert cpu_fused.rotary_takes(x, cos, cos)
    assert not cpu_fused.rotary_takes(x.transpose(0, 1), cos, cos)  # heads not one block a row
    assert not cpu_fused.rotary_takes(x.double(), cos.double(), cos.double())
    assert not cpu_fused.rotary_takes(x, torch.randn(4, 1, 128)[:, :, ::2], cos)  # cos not contiguous


def test_an_engine_s_logprobs_are_the_same_bits_with_the_kernels_on_or_off(tiny_model_dirs, width, monkeypatch):
    """The model's path through the fused kernels (each residual add joined to the norm after it,
    rotary on the fused q/k/v heads) gives the eager path's logprobs exactly, prompt and decode."""
    from workers.engine import LLMEngine, SamplingParams

    calls = {"add_rms_norm": 0, "rotary": 0}
    for name in calls:
        kernel = getattr(cpu_fused, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(cpu_fused, name, counted)

    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 5 for j in range(n)] for i, n in enumerate((3, 40, 129))]
    for arch in ("llama", "qwen3"):
        runs = []
        for on in (True, False):  # the CPU backend with its fused ops, and with aten's (the reference's)
            engine = LLMEngine(tiny_model_dirs[arch], load_progress=False, num_kv_blocks=64, fused_ops=on)
            outs = engine.generate(prompts, params)
            runs.append([(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs])
            if on:  # the kernels ran: two norms and one or two rotations a layer and step
                assert calls["add_rms_norm"] > 0 and calls["rotary"] > 0, calls
                calls = dict.fromkeys(calls, 0)
        assert calls == {"add_rms_norm": 0, "rotary": 0}, "switched off, a kernel still ran"
        assert runs[0] == runs[1], arch


@pytest.mark.parametrize("v", [49152, 151936, 100, 15, 16, 17, 1])
def test_argmax_is_aten_s_index_with_ties_nan_infinities_and_signed_zeros(v):
    gen = torch.Generator().manual_seed(v)
    rows = torch.randn(9, v, generator=gen)
    rows[1] = (rows[1] * 2).round()  # many ties: the first index wins
    rows[2, v // 3] = float("nan")
    rows[2, v // 2] = float("nan")
    rows[3] = float("-inf")
    rows[4, v - 1] = float("inf")
    rows[4, 0] = float("inf")
    rows[5] = -0.0
    rows[5, v // 2 :] = 0.0
    rows[6, v - 1] = float("nan")
    rows[7] = -3.0
    rows[8, v - 1] = 100.0
    assert torch.equal(cpu_fused.argmax(rows), rows.argmax(dim=-1))
    strided = torch.cat([rows, rows], dim=1)[:, :v]  # rows apart by 2v
    assert torch.equal(cpu_fused.argmax(strided), rows.argmax(dim=-1))


def test_greedy_sampling_takes_the_kernel_only_when_every_row_is_greedy(monkeypatch):
    from workers.backends.cpu.backend import CPUOps
    from workers.engine.sampler import sample
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.sequence import Sequence

    argmax = CPUOps().argmax  # the CPU backend's, as the engine passes it
    assert cpu_fused.argmax_usable()  # its self-check's own calls happen now, before counting
    calls = []
    kernel = cpu_fused.argmax
    monkeypatch.setattr(cpu_fused, "argmax", lambda logits: calls.append(logits.shape) or kernel(logits))
    logits = torch.randn(3, 1000)

    def seq(name: str, **params) -> Sequence:
        return Sequence(
            request_id=name, prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=4, **params), arrival_time=0.0
        )

    greedy = [seq(f"g{i}", temperature=0.0) for i in range(3)]
    tokens, _ = sample(logits, greedy, argmax)
    assert tokens == logits.argmax(dim=-1).tolist() and calls == [(3, 1000)]
    mixed = greedy[:2] + [seq("t", temperature=1.0)]
    tokens, _ = sample(logits, mixed, argmax)
    assert tokens[:2] == logits[:2].argmax(dim=-1).tolist() and len(calls) == 1


def test_kv_write_puts_k_and_v_rows_where_index_copy_does_and_refuses_a_slot_out_of_range():
    cache = torch.randn(2, 40, 3, 16)
    fused = torch.randn(5, 9 + 2 * 3, 16)  # q, k, v heads side by side: k and v are strided views
    k, v = fused[:, 9:12], fused[:, 12:15]
    slots = torch.tensor([7, 0, 39, 12, 13])
    assert cpu_fused.kv_write_takes(cache, slots, k, v)
    expected = cache.clone()
    expected[0].index_copy_(0, slots, k)
    expected[1].index_copy_(0, slots, v)
    cpu_fused.kv_write(cache, slots, k, v)
    assert torch.equal(cache, expected)
    with pytest.raises(IndexError, match="out of range"):
        cpu_fused.kv_write(cache, torch.tensor([3, 40, 2, 1, -1]), k, v)
    assert not cpu_fused.kv_write_takes(cache.transpose(2, 3), slots, k, v)
    assert not cpu_fused.kv_write_takes(cache, slots.int(), k, v)


def test_the_load_line_names_the_kernels_that_run(width, monkeypatch):
    line = cpu_fused.describe()
    for name in ("residual add + RMSNorm", "rotary embedding", "KV cache write", "greedy argmax", "SwiGLU"):
        assert name in line
    assert "aten's ops for" not in line
    monkeypatch.setattr(cpu_fused, "rotary_usable", lambda: False)
    assert cpu_fused.describe().endswith("; aten's ops for rotary embedding")


@pytest.mark.parametrize("inner", [1536, 64, 40, 100, 31, 7])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_swiglu_is_silu_of_the_gate_times_up_bit_for_bit(inner, rows):
    """Whole pairs of vectors (Sleef's exp) and tails of each length (libm's), on the fused
    gate/up output's layout, with values where exp overflows, underflows or is not a number."""
    assert cpu_fused.swiglu_usable()
    gen = torch.Generator().manual_seed(inner * 10 + rows)
    wide = torch.randn(rows, 2 * inner + 5, generator=gen) * 8.0
    specials = torch.tensor([0.0, -0.0, 88.7, -88.8, 104.0, -104.0, float("inf"), float("-inf"), float("nan")])
    wide.view(-1)[torch.randperm(wide.numel(), generator=gen)[: len(specials)]] = specials
    gate_up = wide[:, : 2 * inner]  # rows 2 * inner + 5 apart
    assert cpu_fused.swiglu_takes(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = cpu_fused.swiglu(gate_up)
    assert torch.equal(got.view(torch.int32), expected.contiguous().view(torch.int32))


def test_swiglu_takes_only_the_serial_loops_it_copies():
    inner = 1536
    assert cpu_fused.swiglu_takes(torch.randn(8, 2 * inner))
    too_many = cpu_fused.SWIGLU_MAX_ELEMENTS // inner + 1  # aten splits this one over its threads
    assert not cpu_fused.swiglu_takes(torch.randn(too_many, 2 * inner))
    assert not cpu_fused.swiglu_takes(torch.randn(8, 4 * inner)[:, ::2])  # strided columns
    assert not cpu_fused.swiglu_takes(torch.randn(8, 2 * inner, dtype=torch.bfloat16))
    assert not cpu_fused.swiglu_takes(torch.randn(2, 8, 2 * inner))


def test_the_swiglu_check_fails_on_a_kernel_that_differs(monkeypatch):
    """The load-time check can fail: a SwiGLU one ulp off (the up projection nudged) is caught."""

    def nudged(gate_up):
        result = cpu_fused.eager_swiglu(gate_up)
        return torch.nextafter(result, torch.full_like(result, float("inf")))

    monkeypatch.setattr(cpu_fused, "swiglu", nudged)
    assert cpu_fused._swiglu_check() is not None
