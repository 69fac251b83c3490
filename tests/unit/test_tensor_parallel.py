"""Tensor parallelism (workers/models/parallel.py, workers/engine/tensor_parallel.py): the engine
over 2 and 4 ranks (gloo on CPU, real worker processes) equals transformers' greedy generate
token for token; a rank loads exactly its slice of each weight; a dead worker fails the engine
with an error naming it; close() leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tests.unit.engine_helpers import hf_greedy, random_prompts
from tests.unit.test_engine_parity import GREEDY, assert_matches_hf, make_engine
from workers.engine import EngineConfig, LLMEngine, SamplingParams
from workers.engine.tensor_parallel import TensorParallelError
from workers.models.loader import load_model
from workers.models.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding
from workers.models.tiny import make_tiny_model

# The default tiny models have 4 query heads and 2 KV heads: TP 4 replicates each KV head on 2 ranks.
# Four ranks on this suite's 2 cores take ~4x the time of two: qwen2 (qkv biases sliced with the
# replicated heads) runs by default, llama and qwen3 at TP 4 with the slow tests.
PARITY_CASES = [
    *[pytest.param(arch, 2, id=f"{arch}-tp2") for arch in ("llama", "qwen2", "qwen3")],
    pytest.param("qwen2", 4, id="qwen2-tp4"),
    *[pytest.param(arch, 4, id=f"{arch}-tp4", marks=pytest.mark.slow) for arch in ("llama", "qwen3")],
]


TP_SDPA = {"attention_backend": "sdpa"}


@pytest.fixture(scope="module")
def tied_odd_vocab(tmp_path_factory) -> str:
    """Tied embeddings over a vocabulary that no rank count divides: the last shard is padded."""
    out = tmp_path_factory.mktemp("tp-tied") / "llama"
    return str(make_tiny_model(out, arch="llama", seed=2, tie_word_embeddings=True, vocab_size=1001))


@contextlib.contextmanager
def tp_engine(model_dir: str, tp: int, **kwargs):
    """An engine over ``tp`` ranks; on the way out it is closed, and every worker must have
    exited cleanly (SHUTDOWN, exit code 0) and been reaped. Attention is sdpa unless named:
    on auto each worker process compiles the paged kernel (~4 s on these 2 cores), which these
    tests do not set out to check (tests/unit/test_paged_decode.py does); llama-tp2 runs on auto."""
    engine = make_engine(model_dir, tensor_parallel_size=tp, **{**TP_SDPA, **kwargs})
    procs = list(engine.tensor_parallel.procs) if engine.tensor_parallel else []
    assert len(procs) == tp - 1
    try:
        yield engine
    finally:
        engine.close()
        assert_reaped(procs)
        assert [p.returncode for p in procs] == [0] * len(procs)


def assert_reaped(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.returncode is not None, f"worker pid {p.pid} still running after close()"
        with pytest.raises(ProcessLookupError):  # waited for: no zombie either
            os.kill(p.pid, 0)


def shared_prefix_prompts() -> list[list[int]]:
    """The parity suite's 8 mixed-length prompts; every other one starts with one 48-token prefix."""
    prefix = random_prompts((48,), seed=11)[0]
    return [prefix + p if i % 2 else p for i, p in enumerate(random_prompts())]


@pytest.mark.parametrize(("arch", "tp"), PARITY_CASES)
def test_greedy_equals_transformers(tiny_model_dirs, arch, tp):
    """Prefix cache on, prefill chunked to 32 tokens a step, and 26 blocks for 8 prompts of up to
    412 tokens: preemption, recompute and cache hits all happen over the ranks."""
    model_dir = tiny_model_dirs[arch]
    prompts = shared_prefix_prompts()
    backend = "auto" if (arch, tp) == ("llama", 2) else "sdpa"  # auto: paged on CPU, in every rank
    with tp_engine(model_dir, tp, num_kv_blocks=26, max_num_batched_tokens=32, attention_backend=backend) as engine:
        assert engine.runner.attention_backend == ("paged" if backend == "auto" else "sdpa")
        assert engine.kv.num_kv_heads == max(1, 2 // tp)  # this rank's KV heads only
        outs = engine.generate(prompts, GREEDY)
        assert_matches_hf(model_dir, prompts, outs)
        assert engine.stats().preemptions > 0
        assert sum(o.num_cached_tokens for o in outs) > 0
        engine.check_idle()  # every block free again


def test_tied_embeddings_over_a_padded_vocabulary(tied_odd_vocab):
    prompts = random_prompts((5, 40, 130), seed=5)
    with tp_engine(tied_odd_vocab, 2) as engine:
        assert_matches_hf(tied_odd_vocab, prompts, engine.generate(prompts, GREEDY))
        engine.check_idle()


def test_sliding_window_past_three_windows(tmp_path_factory):
    """A windowed model: steps send only the blocks inside each sequence's window (earlier table
    entries are dropped blocks), chunked prefill reads the cache through them."""
    window = 64
    model_dir = str(
        make_tiny_model(tmp_path_factory.mktemp("tp-swa") / "m", arch="mistral", seed=1, sliding_window=window)
    )
    params = SamplingParams(max_tokens=3 * window + 40, temperature=0.0, ignore_eos=True)
    prompts = random_prompts((5, 40, 150), seed=4)
    with tp_engine(model_dir, 2, num_kv_blocks=64, max_num_batched_tokens=24) as engine:
        assert engine.sliding_window == window
        outs = engine.generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_greedy(model_dir, tuple(prompt), params.max_tokens)
        engine.check_idle()


def test_prompt_logprobs_match_one_rank(tiny_llama):
    """Prompt logprobs run the LM head (an all-gather) on every rank, in slices."""
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2)
    prompts = random_prompts((20, 70), seed=6)
    single = make_engine(tiny_llama, max_num_batched_tokens=32).generate(prompts, params)
    with tp_engine(tiny_llama, 2, max_num_batched_tokens=32) as engine:
        outs = engine.generate(prompts, params)
        engine.check_idle()
    for a, b in zip(outs, single, strict=True):
        assert a.token_ids == b.token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x is not None and y is not None
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_constrained_output_and_controls_match_one_rank(tiny_llama):
    """Grammars and logits controls run on rank 0's gathered logits: a JSON-schema request and
    a penalized one give one rank's tokens."""
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["tags"],
    }
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, structured=("json_schema", json.dumps(schema))),
        SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=1.0, logit_bias=((7, 3.0),), min_tokens=12),
    ]
    prompts = random_prompts((20, 33), seed=8)
    single = make_engine(tiny_llama).generate(prompts, params)
    with tp_engine(tiny_llama, 2) as engine:
        outs = engine.generate(prompts, params)
        engine.check_idle()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert outs[0].finish_reason == "stop" and isinstance(json.loads(outs[0].text)["tags"], list)


def test_dead_worker_fails_the_engine_clearly(tiny_llama):
    engine = make_engine(tiny_llama, tensor_parallel_size=2, **TP_SDPA)
    assert engine.tensor_parallel is not None
    procs = list(engine.tensor_parallel.procs)
    try:
        prompt = random_prompts((10,), seed=8)
        assert len(engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids) == 4
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        errors: list[BaseException] = []

        def generate() -> None:
            try:
                engine.generate(prompt, GREEDY)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the engine hung on a dead worker"
        assert len(errors) == 1 and isinstance(errors[0], TensorParallelError)
        message = str(errors[0])
        assert f"rank 1 (pid {procs[0].pid}) exited with code {-signal.SIGKILL}" in message
        with pytest.raises(TensorParallelError, match="rank 1"):  # and from then on
            engine.step()
    finally:
        engine.close()
    assert_reaped(procs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where a worker cannot take a CUDA device")
def test_a_worker_failing_to_start_is_named_with_its_error(tiny_llama):
    """A worker on CUDA without CUDA fails before joining; rank 0 reports it with the last line
    of its traceback (left in the store) instead of waiting for it."""
    message = r"worker rank 1 \(pid \d+\) exited with code 1 while starting: \w+Error: .+"
    with pytest.raises(TensorParallelError, match=message):
        LLMEngine(tiny_llama, load_progress=False, num_kv_blocks=8, tensor_parallel_size=2, device="cuda")


def test_workers_exit_when_rank_0_dies(tiny_llama):
    """Rank 0 killed outright (no close()): its workers see the sockets close and exit."""
    code = (
        "import sys; from workers.engine import LLMEngine; "
        f"e = LLMEngine({tiny_llama!r}, load_progress=False, num_kv_blocks=64, tensor_parallel_size=2, "
        "attention_backend='sdpa'); "
        "print(*(p.pid for p in e.tensor_parallel.procs), flush=True); sys.stdin.read()"
    )
    rank0 = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert rank0.stdout is not None
        pids = [int(pid) for pid in rank0.stdout.readline().split()]
        assert len(pids) == 1 and running(pids[0])
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 60  # a bound against a hang, not a measurement
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids), f"worker {pids} outlived rank 0"


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_config_refuses_what_does_not_split(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig(model_dir=tiny_llama, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="4 attention heads do not split over 3 ranks"):
        EngineConfig(model_dir=tiny_llama, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="eager only"):
        EngineConfig(model_dir=tiny_llama, tensor_parallel_size=2, enforce_eager=False)
    three_kv = make_tiny_model(tmp_path / "m", arch="llama", hidden_size=48, num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match="3 KV heads neither split over 2 ranks nor replicate"):
        EngineConfig(model_dir=str(three_kv), tensor_parallel_size=2)
    EngineConfig(model_dir=str(three_kv), tensor_parallel_size=3)  # 2 query heads and 1 KV head a rank


def test_the_ray_launcher_needs_a_placement_group_and_launchers_are_named(tiny_llama):
    """Outside a Ray actor in a placement group the Ray launcher refuses at once, saying what it
    needs (and starts no Ray); an unknown launcher is refused by name. Nothing is started."""
    import ray

    from workers.engine.tensor_parallel import TensorParallelWorkers

    config = EngineConfig(model_dir=tiny_llama, tensor_parallel_size=2)
    ray_was_up = ray.is_initialized()  # the suite's integration cluster may be up in this process
    with pytest.raises(TensorParallelError, match="placement group of at least that many bundles"):
        TensorParallelWorkers.launch(config, "ray")
    assert ray.is_initialized() == ray_was_up  # it started no Ray
    with pytest.raises(ValueError, match="tp_launcher 'mpi'"):
        LLMEngine(tiny_llama, tensor_parallel_size=2, tp_launcher="mpi")


# ------------------------------------------------------------ layers and loading
def test_layers_at_world_size_one_are_the_plain_ops():
    torch.manual_seed(0)
    single = TPGroup()
    x = torch.randn(5, 12)
    for bias in (False, True):
        plain = nn.Linear(12, 8, bias=bias)
        for layer in (ColumnParallelLinear(12, 8, bias, single), RowParallelLinear(12, 8, bias, single)):
            layer.load_state_dict(plain.state_dict())
            assert torch.equal(layer(x), plain(x))
    table = nn.Embedding(30, 12)
    embedding = VocabParallelEmbedding(30, 12, single)
    embedding.load_state_dict(table.state_dict())
    ids = torch.tensor([0, 7, 29, 7])
    assert torch.equal(embedding(ids), table(ids))
    assert torch.equal(embedding.logits(x), F.linear(x, table.weight))


# 2 KV heads: one each over 2 ranks; over 4, ranks 0-1 use head 0 and ranks 2-3 head 1 (their
# query heads 0-1 and 2-3 form GQA groups 0 and 1).
KV_HEAD_OF_RANK = {2: [0, 1], 4: [0, 0, 1, 1]}


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_exactly_its_slice(tiny_model_dirs, tied_odd_vocab, tp):
    """Parameters of rank r are the checkpoint's rows/columns for r: query heads and MLP rows
    evenly, KV heads evenly or the one its query heads use, vocabulary rows padded with zeros."""
    for model_dir in (tiny_model_dirs["qwen2"], tied_odd_vocab):  # qkv biases; tied, 1001 rows
        full = load_file(os.path.join(model_dir, "model.safetensors"))
        d = 16  # head_dim of the default tiny model (64 hidden / 4 heads)
        for rank in range(tp):
            model = load_model(model_dir, progress=False, tp=TPGroup(rank, tp))
            params = dict(model.named_parameters())
            attn = "model.layers.1.self_attn"
            heads = 4 // tp
            q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
            kv_head = KV_HEAD_OF_RANK[tp][rank]
            kv_rows = slice(kv_head * d, (kv_head + 1) * d)
            inner = full["model.layers.1.mlp.gate_proj.weight"].shape[0] // tp
            expected = {
                f"{attn}.q_proj.weight": full[f"{attn}.q_proj.weight"][q_rows],
                f"{attn}.k_proj.weight": full[f"{attn}.k_proj.weight"][kv_rows],
                f"{attn}.v_proj.weight": full[f"{attn}.v_proj.weight"][kv_rows],
                f"{attn}.o_proj.weight": full[f"{attn}.o_proj.weight"][:, q_rows],
                "model.layers.1.mlp.up_proj.weight": full["model.layers.1.mlp.up_proj.weight"][
                    rank * inner : (rank + 1) * inner
                ],
                "model.layers.1.mlp.down_proj.weight": full["model.layers.1.mlp.down_proj.weight"][
                    :, rank * inner : (rank + 1) * inner
                ],
                "model.norm.weight": full["model.norm.weight"],
            }
            if f"{attn}.k_proj.bias" in full:
                expected[f"{attn}.k_proj.bias"] = full[f"{attn}.k_proj.bias"][kv_rows]
                expected[f"{attn}.q_proj.bias"] = full[f"{attn}.q_proj.bias"][q_rows]
            for name, want in expected.items():
                assert torch.equal(params[name], want), f"rank {rank}: {name}"
            vocab = full["model.embed_tokens.weight"]
            per_rank = -(-vocab.shape[0] // tp)
            rows = vocab[rank * per_rank : (rank + 1) * per_rank]
            embed = params["model.embed_tokens.weight"]
            assert embed.shape == (per_rank, vocab.shape[1])
            assert torch.equal(embed[: rows.shape[0]], rows)
            assert not embed[rows.shape[0] :].any()  # padding rows past the vocabulary
            if "lm_head.weight" in full:
                assert torch.equal(
                    params["lm_head.weight"], full["lm_head.weight"][rank * per_rank : (rank + 1) * per_rank]
                )


def _on_a_q4_1_grid(model_dir: str, out_dir) -> str:
    """A copy of ``model_dir`` whose 2-D weights went through GGUF's Q4_1 and back (as ``pdserve
    pull`` gets a GGUF checkpoint's), so that the panel kernel may hold them coded."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    from safetensors.torch import save_file

    q4_1 = gguf.GGMLQuantizationType.Q4_1
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    for name, t in tensors.items():
        if t.dim() == 2 and t.shape[1] % 32 == 0:
            tensors[name] = torch.from_numpy(dequantize(quantize(t.numpy(), q4_1), q4_1).reshape(t.shape).copy())
    out_dir.mkdir()
    for entry in os.listdir(model_dir):
        if entry != "model.safetensors":
            with open(os.path.join(model_dir, entry), "rb") as src, open(out_dir / entry, "wb") as dst:
                dst.write(src.read())
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)


def test_ranks_hold_coded_shards_and_equal_transformers(tiny_llama, tmp_path):
    """Coded panels over 2 ranks: each column shard (q/k/v, gate/up) and row shard (o, down: 32
    and 64 inputs a rank, whole groups) codes on its own, and greedy output equals transformers'."""
    from workers.backends.cpu import panels as cpu_linear
    from workers.backends.cpu.linears import _packed_units

    if not cpu_linear.coded_available():
        pytest.skip("the coded panel kernel did not build (no C++ compiler)")
    model_dir = _on_a_q4_1_grid(tiny_llama, tmp_path / "q4_1")
    prompts = random_prompts((5, 40, 130), seed=6)
    with tp_engine(model_dir, 2, plain_linear_rows=64) as engine:
        units = _packed_units(engine.model)
        assert units and all(isinstance(u.panels, cpu_linear.CodedPanels) for u in units)
        assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))
