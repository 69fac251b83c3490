"""The memory plan (workers/engine/memory_plan.py): its arithmetic on a simulated device, exact;
its refusals; kv-plan and the engine agreeing on the same inputs; the CPU budget path; and the
profile run itself, on CPU, through a probe that counts the bytes of the tensors torch makes."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.unit.test_kv_plan import LLAMA3_8B
from workers.backends.base import Backend
from workers.engine import EngineConfig, LLMEngine, SamplingParams
from workers.engine import assemble as assemble_module
from workers.engine.kv_plan import plan_kv
from workers.engine.memory_plan import (
    GIB,
    MIB,
    TRANSFER_THREADS,
    DeviceUsage,
    MemoryPlanError,
    MemorySettings,
    ProfileStep,
    budget_usage,
    communicator_bytes,
    device_budget,
    graph_bytes,
    plan_memory,
    profile_step,
    staging_bytes,
)
from workers.engine.model_runner import ModelRunner
from workers.layers.kv_cache import bytes_per_block
from workers.models.config import ModelConfig
from workers.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory) -> ModelConfig:
    path = tmp_path_factory.mktemp("llama3-8b-config")
    (path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return ModelConfig.from_dir(path)


def profiled(total: int, weights: int, activation: int, other: int, utilization: float = 0.9, free: int | None = None):
    budget, label = device_budget(total, utilization, free)
    capped = budget < int(total * utilization)
    return DeviceUsage("profile", budget, label, weights, activation, other, capped=capped)


# ---------------------------------------------------------------------------------- the arithmetic
def test_the_plan_on_a_simulated_device_is_exact(llama3_8b):
    # bf16, 8 KV heads x 128 x 32 layers: 128 KiB a token, 2 MiB a 16-token block
    assert bytes_per_block(llama3_8b, 16, "auto", torch.bfloat16) == 2 * MIB
    settings = MemorySettings(
        max_model_len=8192,
        kv_transfer_slots=2,  # 2 x 512 blocks x 2 MiB
        kv_transfer_peers=3,  # 3 x 256 MiB
        cuda_graphs=True,
        graph_batch_sizes=(1, 2, 4),
        cuda_graph_bytes=int(1.5 * GIB),
    )
    usage = profiled(80 * GIB, weights=15 * GIB, activation=3 * GIB, other=512 * MIB)
    plan = plan_memory(settings, llama3_8b, torch.bfloat16, usage, "cuda:0")
    assert (plan.staging_bytes, plan.graph_bytes, plan.communicator_bytes) == (2 * GIB, int(1.5 * GIB), 768 * MIB)
    # 72 - 15 - 3 - 2 - 1.5 - 0.75 - 0.5 = 49.25 GiB of 2 MiB blocks
    assert plan.kv_bytes == int(49.25 * GIB) and plan.num_blocks == 25216 and plan.tokens == 403456
    assert plan.line() == (
        "memory plan (profile, cuda:0): 0.90 x 80.00 GiB = 72.00 GiB - weights 15.00 GiB - activation peak "
        "3.00 GiB - kv staging 2.00 GiB - cuda graphs 1.50 GiB - communicators 768.00 MiB - other 512.00 MiB "
        "= KV cache 49.25 GiB: 25216 blocks, 403456 tokens"
    )
    assert plan.refusal() is None
    plan.check()
    # a budget short of one block's bytes rounds down
    short = plan_memory(
        settings, llama3_8b, torch.bfloat16, dataclasses.replace(usage, other_bytes=512 * MIB + 1), "cuda:0"
    )
    assert short.num_blocks == 25215


def test_the_budget_is_capped_at_what_was_free_when_the_replica_started(llama3_8b):
    settings = MemorySettings(max_model_len=4096, gpu_memory_utilization=0.45)
    # another replica holds 60 GiB: this one's 0.45 share (36 GiB) is not there
    usage = profiled(80 * GIB, weights=15 * GIB, activation=1 * GIB, other=0, utilization=0.45, free=20 * GIB)
    plan = plan_memory(settings, llama3_8b, torch.bfloat16, usage, "cuda:1")
    assert plan.budget_bytes == 20 * GIB and plan.num_blocks == 4 * GIB // (2 * MIB)
    assert plan.line().startswith(
        "memory plan (profile, cuda:1): 0.45 x 80.00 GiB capped at 20.00 GiB free at start = 20.00 GiB - "
    )
    # refused, the advice is to free the device, not to ask for a larger share of it
    more = dataclasses.replace(usage, other_bytes=4 * GIB)
    crowded = plan_memory(settings, llama3_8b, torch.bfloat16, more, "cuda:1")
    refusal = crowded.refusal() or ""
    assert "free the device: other processes held part of its --gpu-memory-utilization 0.45 share" in refusal
    assert "raise --gpu-memory-utilization" not in refusal


def test_reserve_rules(llama3_8b, tmp_path):
    dtype = torch.bfloat16
    per_block = 2 * MIB
    plain = MemorySettings(max_model_len=8192)
    assert (staging_bytes(plain, llama3_8b, dtype), graph_bytes(plain, llama3_8b, dtype)) == (0, 0)
    assert communicator_bytes(plain) == 0
    # staging: slots x one whole sequence's blocks, never more slots than the transfer threads
    assert staging_bytes(dataclasses.replace(plain, kv_transfer_slots=3), llama3_8b, dtype) == 3 * 512 * per_block
    many = dataclasses.replace(plain, kv_transfer_slots=100)
    assert staging_bytes(many, llama3_8b, dtype) == TRANSFER_THREADS * 512 * per_block
    # with a sliding window a sequence holds its window's blocks and the one being written
    mistral = ModelConfig.from_dir(make_tiny_model(tmp_path / "m", arch="mistral", sliding_window=64))
    windowed = MemorySettings(max_model_len=1024, kv_transfer_slots=1)
    assert staging_bytes(windowed, mistral, torch.float32) == (64 // 16 + 1) * bytes_per_block(
        mistral, 16, "auto", torch.float32
    )
    # communicators: one per transfer peer, the configured size
    peers = dataclasses.replace(plain, kv_transfer_peers=2, communicator_bytes=100 * MIB)
    assert communicator_bytes(peers) == 200 * MIB
    # CUDA graphs: the configured figure, else the largest bucket's rows through every layer plus
    # their fp32 logits, and a fixed cost per graph
    graphs = dataclasses.replace(plain, cuda_graphs=True, graph_batch_sizes=(1, 2, 4, 8))
    layer_row = 2 * (2 * 4096 + (32 + 16) * 128 + 32 * 128 + 3 * 14336)
    assert graph_bytes(graphs, llama3_8b, dtype) == 8 * (32 * layer_row + 4 * 128256) + 4 * 16 * MIB
    assert graph_bytes(dataclasses.replace(graphs, cuda_graph_bytes=GIB), llama3_8b, dtype) == GIB


def test_the_profiled_step_fills_every_slot_and_every_token():
    # the tokens one chunk leaves to one-token decodes: all at the end of a max_model_len context
    assert profile_step(2048, 128, 8192) == ProfileStep(context=8192, decodes=127, chunk=1921)
    assert profile_step(8192, 256, 32768) == ProfileStep(32768, 255, 7937)
    # a budget longer than one chunk can take: decodes become fresh prompts of up to max_model_len
    step = profile_step(8192, 4, 2048)
    assert step == ProfileStep(2048, 0, 2048, (2048, 2048, 2048))
    assert (step.num_tokens, step.num_seqs) == (8192, 4)
    assert profile_step(600, 3, 256) == ProfileStep(256, 0, 256, (256, 88))
    # fewer tokens than slots: every token a decode; one slot: one chunk as long as allowed
    assert profile_step(100, 128, 4096) == ProfileStep(4096, 100, 0)
    assert profile_step(2048, 1, 1024) == ProfileStep(1024, 0, 1024)
    for args in ((2048, 128, 8192), (64, 4, 256), (8192, 4, 2048), (600, 3, 256), (100, 128, 4096)):
        step = profile_step(*args)
        assert step.num_tokens == min(args[0], args[1] * args[2]) and step.num_seqs == min(args[0], args[1])
    # blocks the step writes, each sequence its own: 3 decodes' last blocks, the chunk's 4
    assert profile_step(64, 4, 256).written_blocks(16) == 3 + 4


# ---------------------------------------------------------------------------------- refusals
def test_refusals_name_what_to_change(llama3_8b):
    settings = MemorySettings(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=256, kv_transfer_slots=1)
    # 1 GiB staging; 72 - 60 - 10 - 1 = 1 GiB left: 512 blocks, exactly one 8192-token sequence
    usage = profiled(80 * GIB, weights=60 * GIB, activation=10 * GIB, other=0)
    fits = plan_memory(settings, llama3_8b, torch.bfloat16, usage, "cuda:0")
    assert (fits.num_blocks, fits.min_blocks) == (512, 512) and fits.refusal() is None
    short = plan_memory(settings, llama3_8b, torch.bfloat16, dataclasses.replace(usage, other_bytes=1), "cuda:0")
    assert short.num_blocks == 511
    with pytest.raises(MemoryPlanError) as refused:
        short.check()
    message = str(refused.value)
    assert message.startswith(
        "the KV cache would get 511 KV blocks (8176 tokens), fewer than one sequence of max_model_len 8192 "
        "needs (512 blocks, 1.00 GiB). Change one of: "
    )
    for fix in (
        "raise --gpu-memory-utilization (now 0.9)",
        "lower --max-num-batched-tokens (now 8192) or --max-num-seqs (now 256): the largest step's "
        "activations take 10.00 GiB",
        "lower --max-model-len (now 8192)",
        "a larger --tp (now 1)",
        "--kv-cache-dtype int8",
        "fewer --kv-transfer-slots (now 1)",
    ):
        assert fix in message
    assert message.endswith("\n" + short.line())
    # with an int8 cache already, no int8 advice
    int8 = dataclasses.replace(settings, kv_cache_dtype="int8")
    over = plan_memory(int8, llama3_8b, torch.bfloat16, dataclasses.replace(usage, weight_bytes=80 * GIB), "cuda:0")
    assert over.kv_bytes < 0 and over.num_blocks == 0
    assert "--kv-cache-dtype" not in (over.refusal() or "")


def test_an_unset_max_model_len_is_lowered_but_never_below_one_steps_chunk(llama3_8b):
    settings = MemorySettings(max_num_batched_tokens=2048)  # the model's own length: 8192
    usage = profiled(80 * GIB, weights=71 * GIB + 768 * MIB, activation=0, other=0)  # 256 MiB: 128 blocks
    plan = plan_memory(settings, llama3_8b, torch.bfloat16, usage, "cuda:0")
    assert (plan.num_blocks, plan.min_blocks, plan.min_context) == (128, 128, 2048) and plan.refusal() is None
    fewer = plan_memory(settings, llama3_8b, torch.bfloat16, dataclasses.replace(usage, other_bytes=1), "cuda:0")
    refusal = fewer.refusal() or ""
    assert "fewer than one step's prompt chunk of 2048 tokens needs (128 blocks" in refusal
    assert "set --max-model-len below the model's own" in refusal


def test_ranks_agree_on_the_fewest_blocks(llama3_8b):
    usage = profiled(80 * GIB, weights=15 * GIB, activation=3 * GIB, other=0)
    plan = plan_memory(MemorySettings(max_model_len=8192), llama3_8b, torch.bfloat16, usage, "cuda:0")
    assert plan.agreed(plan.num_blocks + 5) is plan  # another rank holds more: this one's count
    fewer = plan.agreed(100)
    assert fewer.num_blocks == 100 and fewer.line().endswith(
        "= KV cache 200.00 MiB: 100 blocks, 1600 tokens (the fewest any tensor-parallel rank holds)"
    )
    assert "100 KV blocks (1600 tokens) on the tensor-parallel rank that holds the fewest" in (fewer.refusal() or "")


# ---------------------------------------------------------------------------------- the engine
class ScriptedProbe:
    """A device that reports set figures: empty at the start, then ``weights`` allocated (the
    peak ``activation`` above them) and ``other`` bytes outside the allocator."""

    def __init__(self, total: int, weights: int, activation: int, other: int) -> None:
        self._total, self.weights, self.activation, self.other = total, weights, activation, other
        self.calls = {"used": 0, "allocated": 0}

    def total(self) -> int:
        return self._total

    def used(self) -> int:
        self.calls["used"] += 1
        return 0 if self.calls["used"] == 1 else self.weights + self.other

    def allocated(self) -> int:
        self.calls["allocated"] += 1
        return 0 if self.calls["allocated"] == 1 else self.weights

    def peak(self) -> int:
        return self.weights + self.activation

    def reset_peak(self) -> None:
        pass


class CountingProbe(TorchDispatchMode):
    """A device made of the tensors torch creates while the mode is on: each new storage counts
    its bytes until it is freed (storages keep their Python object while they live, so a
    finalizer fires exactly when one dies)."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self._total = total
        self.live: dict[int, int] = {}
        self.current = self.high = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # an opaque (e.g. oneDNN) tensor: not counted
            return
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += self.live[key]
        self.high = max(self.high, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def total(self) -> int:
        return self._total

    def used(self) -> int:
        return self.current

    def allocated(self) -> int:
        return self.current

    def peak(self) -> int:
        return self.high

    def reset_peak(self) -> None:
        self.high = self.current


def plan_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan (")]


def test_kv_plan_and_the_engine_agree_on_the_same_inputs(tiny_llama, monkeypatch, caplog):
    model = ModelConfig.from_dir(tiny_llama)
    step = dict(max_num_batched_tokens=256, max_num_seqs=8)
    reserves = dict(kv_transfer_slots=2, kv_transfer_peers=1, communicator_memory_mib=4)
    estimate = plan_kv(model, 0.05, 512, 1, dtype="float32", **reserves, **step)
    memory = estimate.memory
    assert memory is not None and memory.num_blocks > 0 and memory.activation_bytes > 0
    config = EngineConfig(model_dir=tiny_llama, max_model_len=512, load_progress=False, **reserves, **step)
    # the same settings from the engine's config and from kv-plan's flags
    assert MemorySettings.from_config(config, torch.device("cuda")) == memory.settings
    # an engine whose device reports exactly kv-plan's estimates plans the same blocks
    probe = ScriptedProbe(int(0.05 * GIB), memory.weight_bytes, memory.activation_bytes, memory.other_bytes)
    monkeypatch.setattr(Backend, "memory_probe", lambda self: probe)
    with caplog.at_level(logging.INFO, logger="workers.engine.assemble"):
        engine = LLMEngine(config=config)
    assert engine.num_kv_blocks == estimate.num_blocks == memory.num_blocks
    (line,) = plan_lines(caplog)
    assert line.startswith("memory plan (profile, cpu): ")
    assert line.split("): ", 1)[1] == memory.line().split("): ", 1)[1]


def test_engine_defaults_are_the_plans():
    assert MemorySettings() == MemorySettings.from_config(EngineConfig(model_dir="."), torch.device("cpu"))


def test_the_cpu_engine_plans_against_its_budget(tiny_llama, caplog):
    model = ModelConfig.from_dir(tiny_llama)
    per_block = bytes_per_block(model, 16, "auto", torch.float32)
    with caplog.at_level(logging.INFO, logger="workers.engine.assemble"):
        engine = LLMEngine(tiny_llama, kv_cache_memory_gib=0.01, max_model_len=1024, load_progress=False)
    budget = int(0.01 * GIB)
    assert engine.num_kv_blocks == budget // per_block
    expected = plan_memory(MemorySettings(max_model_len=1024), model, torch.float32, budget_usage(0.01), "cpu").line()
    assert plan_lines(caplog) == [expected]
    assert expected == (
        "memory plan (budget, cpu): kv_cache_memory_gib (the KV cache alone) = 10.24 MiB = "
        f"KV cache 10.23 MiB: {budget // per_block} blocks, {budget // per_block * 16} tokens"
    )
    # the reserves are the GPU's: a KV-only budget never pays them
    reserved = LLMEngine(tiny_llama, kv_cache_memory_gib=0.01, kv_transfer_slots=4, load_progress=False)
    assert reserved.num_kv_blocks == engine.num_kv_blocks
    # a budget short of one max_model_len sequence is refused, naming what to change
    too_small = (63 * per_block + 100) / GIB  # 63 blocks; 1024 tokens need 64
    with pytest.raises(MemoryPlanError) as refused:
        LLMEngine(tiny_llama, kv_cache_memory_gib=too_small, max_model_len=1024, load_progress=False)
    message = str(refused.value)
    assert "fewer than one sequence of max_model_len 1024 needs (64 blocks" in message
    assert "raise --kv-cache-memory-gib" in message and "lower --max-model-len (now 1024)" in message
    # without max_model_len the model's own is lowered to the cache, down to one step's chunk
    lowered = LLMEngine(tiny_llama, kv_cache_memory_gib=too_small, max_num_batched_tokens=512, load_progress=False)
    assert lowered.num_kv_blocks == 63 and lowered.max_model_len == 63 * 16


def test_the_profile_runs_the_largest_step_on_a_temporary_cache(tiny_llama, monkeypatch, caplog):
    probe = CountingProbe(total=64 * MIB)
    monkeypatch.setattr(Backend, "memory_probe", lambda self: probe)
    steps = []  # what each step ran on and its items, copied (holding the runner would keep its cache)
    real_execute = ModelRunner.execute

    def execute(self, out):
        items = [
            (d.num_new_tokens, d.seq.num_computed_tokens, d.seq.num_tokens, list(d.seq.block_table), d.completes)
            for d in out.decodes + out.prefills
        ]
        targets = [d.seq.prompt_logprob_targets(d.seq.num_computed_tokens, d.seq.num_tokens) for d in out.prefills]
        steps.append((self.kv.num_blocks, len(out.decodes), out.num_tokens, items, targets))
        return real_execute(self, out)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    profiles = []
    real_profile = assemble_module.profile_memory

    def profile(*args, **kwargs):
        usage, result = real_profile(*args, **kwargs)
        profiles.append((usage, result))
        return usage, result

    monkeypatch.setattr(assemble_module, "profile_memory", profile)
    config = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, load_progress=False)
    with probe, caplog.at_level(logging.INFO, logger="workers.engine.assemble"):
        engine = LLMEngine(tiny_llama, **config)
    ((cache_blocks, num_decodes, num_tokens, items, targets),) = steps
    ((usage, result),) = profiles

    # the batch: 3 decodes at the end of a 256-token context, one 61-token chunk ending there,
    # over a temporary cache of 8 blocks (block 0 for every block only read)
    assert result.step == ProfileStep(256, 3, 61) and (num_decodes, num_tokens) == (3, 64)
    assert [item[:3] + item[4:] for item in items] == [(1, 255, 256, True)] * 3 + [(61, 195, 256, True)]
    assert targets == [range(195, 255)]  # the chunk's rows score prompt logprobs
    tables = [item[3] for item in items]
    assert all(len(t) == 16 for t in tables)
    written = [t[-1] for t in tables[:3]] + tables[3][12:]  # each block a token is written to
    assert sorted(written) == list(range(1, 8)) and all(b == 0 for t in tables for b in t if b not in written)
    assert cache_blocks == 8 != engine.kv.num_blocks

    # the temporary cache was in place before the peak was reset, and gone afterwards
    model = ModelConfig.from_dir(tiny_llama)
    assert result.temporary_cache_bytes == 8 * bytes_per_block(model, 16, "auto", torch.float32)
    assert result.baseline - result.loaded == result.temporary_cache_bytes
    assert result.after == result.loaded > result.start
    assert usage.weight_bytes == result.loaded - result.start and usage.other_bytes == 0
    assert usage.activation_bytes == result.peak - result.baseline > 0

    # the plan: 0.9 of the device less those, the line logged
    per_block = bytes_per_block(model, 16, "auto", torch.float32)
    left = int(64 * MIB * 0.9) - usage.weight_bytes - usage.activation_bytes
    assert engine.num_kv_blocks == left // per_block
    (line,) = plan_lines(caplog)
    assert line.startswith("memory plan (profile, cpu): 0.90 x 64.00 MiB = 57.60 MiB - weights ")

    # nothing of the step reached the engine, and it serves as one that never profiled
    assert engine.scheduler.requests == {} and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    assert engine.stats().busy_s == 0 and engine.stats().prefill_tokens_computed == 0
    steps.clear()
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    reference = LLMEngine(tiny_llama, num_kv_blocks=64, **config)
    assert engine.generate([prompt], params)[0].token_ids == reference.generate([prompt], params)[0].token_ids


def test_tensor_parallel_ranks_each_profile_the_step_and_agree_on_the_fewest_blocks(tiny_llama, monkeypatch):
    """Both ranks in this process (threads, gloo), so that the probe reaches each: they run the
    profile's step together (its collectives match), and the rank whose device holds less sets
    the block count for both."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from workers.engine.assemble import ContextPlan, assemble, plan_context
    from workers.engine.tensor_parallel import RankGroups

    model = ModelConfig.from_dir(tiny_llama)
    config = EngineConfig(
        model_dir=tiny_llama,
        tensor_parallel_size=2,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=256,
        load_progress=False,
    )
    weights, activation = 2 * MIB, MIB
    probes = {rank: ScriptedProbe((64 - 16 * rank) * MIB, weights, activation, 0) for rank in (0, 1)}
    rank_of = threading.local()
    monkeypatch.setattr(Backend, "memory_probe", lambda self: probes[rank_of.rank])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def rank(r: int):
        rank_of.rank = r
        own_store = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        groups = RankGroups(own_store, r, 2, torch.device("cpu"), "127.0.0.1")
        try:
            settle = (
                (lambda m, n: plan_context(config, m, n)) if r == 0 else (lambda m, n: ContextPlan(256, None, None))
            )
            return assemble(config, torch.device("cpu"), groups.tp, groups.agree_num_blocks, settle, rank0=r == 0)
        finally:
            groups.close()

    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(rank, (0, 1)))
    # each rank holds one of the model's two KV heads: half of a whole block's bytes
    per_block = bytes_per_block(dataclasses.replace(model, num_kv_heads=1), 16, "auto", torch.float32)
    own = [(int(probes[r].total() * 0.9) - weights - activation) // per_block for r in (0, 1)]
    assert own[1] < own[0]
    assert [p.kv.num_blocks for p in parts] == [own[1], own[1]]
    memory = [p.memory for p in parts]
    assert memory[0] is not None and memory[1] is not None
    assert (memory[0].num_blocks, memory[0].limited_by_another_rank) == (own[1], True)
    assert (memory[1].num_blocks, memory[1].limited_by_another_rank) == (own[1], False)
    assert memory[0].line().endswith("(the fewest any tensor-parallel rank holds)")
