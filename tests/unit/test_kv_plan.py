"""`pdserve kv-plan`: KV sizing from a model's config, checked against known figures and against
what the engine actually allocates."""

from __future__ import annotations

import json

import pytest
import torch

from deploy.ops.cli import main
from workers.engine import LLMEngine
from workers.engine.kv_plan import plan_kv
from workers.models.config import ModelConfig
from workers.models.tiny import make_tiny_model

# Llama-3-8B's published shape: 32 layers x 8 KV heads x 128 dims, bf16 -> 128 KiB per token.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama3-8b-config")
    (path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return str(path)


def test_llama3_8b_figures(llama3_8b):
    model = ModelConfig.from_dir(llama3_8b)
    auto = plan_kv(model, gpu_mem_gib=80, context=8192, concurrency=64)
    assert auto.bytes_per_token == 131072 and auto.model_dtype == "bfloat16"
    assert auto.weight_bytes == model.num_params * 2 and 8.0e9 < model.num_params < 8.1e9
    # the engine's memory plan with estimates: 90 % of the GPU less the weights (with the rotary
    # tables loading builds) and the largest step's activations; no reserves (eager, no transfers)
    memory = auto.memory
    assert memory is not None and memory.budget_bytes == int(80 * 2**30 * 0.9)
    assert memory.weight_bytes == auto.weight_bytes + 2 * 8192 * 128 * 4
    assert auto.kv_budget_bytes == memory.budget_bytes - memory.weight_bytes - memory.activation_bytes
    assert auto.num_blocks == auto.kv_budget_bytes // (16 * 131072)
    assert auto.blocks_per_sequence == 512 and auto.max_concurrency == auto.num_blocks // 512
    assert not auto.fits and auto.replicas_needed == 2
    int8 = plan_kv(model, 80, 8192, 64, kv_cache_dtype="int8")
    # one byte per element plus a scale row per 16-token block: 17/32 of bf16
    assert int8.bytes_per_block * 32 == auto.bytes_per_block * 17
    assert int8.fits and int8.max_concurrency > auto.max_concurrency
    # per byte of budget int8 holds 32/17 of the tokens, but its gather dequantizes through fp32:
    # the largest step's activations take more of the GPU than bf16's
    assert int8.memory is not None and int8.memory.activation_bytes > memory.activation_bytes


def test_reserves_come_out_of_the_kv_budget(llama3_8b, capsys):
    model = ModelConfig.from_dir(llama3_8b)
    base = plan_kv(model, 80, 8192, 64)
    reserved = plan_kv(model, 80, 8192, 64, kv_transfer_slots=2, kv_transfer_peers=3, enforce_eager=False)
    memory = reserved.memory
    assert memory is not None and base.memory is not None
    assert memory.staging_bytes == 2 * 512 * 2 * 2**20  # two whole 8192-token sequences in flight
    assert memory.communicator_bytes == 3 * 256 * 2**20 and memory.graph_bytes > 0
    spent = memory.staging_bytes + memory.communicator_bytes + memory.graph_bytes
    assert reserved.kv_budget_bytes == base.kv_budget_bytes - spent
    assert main(["kv-plan", "--model", llama3_8b, "--gpu-mem", "80", "--context", "8192", "--concurrency", "8"]) == 0
    out = capsys.readouterr().out
    assert "steps of 2048 tokens over 128 sequences at context 8192" in out
    assert "  memory plan (estimate, a GPU of 80 GiB): 0.90 x 80.00 GiB = 72.00 GiB - weights 14.97 GiB - " in out


def test_plan_matches_what_the_engine_allocates(tiny_llama):
    budget_gib = 0.01
    for kind in ("auto", "int8"):
        engine = LLMEngine(tiny_llama, kv_cache_dtype=kind, kv_cache_memory_gib=budget_gib, load_progress=False)
        allocated = sum(t.numel() * t.element_size() for t in engine.kv_caches)
        plan = plan_kv(ModelConfig.from_dir(tiny_llama), 1, 256, 1, kind, dtype="float32")
        assert allocated == engine.num_kv_blocks * plan.bytes_per_block
        assert engine.num_kv_blocks == int(budget_gib * 2**30) // plan.bytes_per_block
        assert engine.kv.dtype == (torch.float32 if kind == "auto" else torch.int8)


def test_sliding_window_caps_blocks_per_sequence(tmp_path):
    model = ModelConfig.from_dir(make_tiny_model(tmp_path / "m", arch="mistral", sliding_window=64))
    plan = plan_kv(model, gpu_mem_gib=1, context=4096, concurrency=8)
    assert plan.blocks_per_sequence == 64 // 16 + 1  # not 256: blocks behind the window are freed


def test_cli_prints_the_table_and_exit_code(llama3_8b, capsys):
    assert (
        main(["kv-plan", "--model", llama3_8b, "--gpu-mem", "80", "--context", "8192", "--concurrency", "64"]) == 1
    )  # does not fit one replica in bf16
    out = capsys.readouterr().out
    assert "32 layers x 8 KV heads x head_dim 128" in out and "131,072" in out
    assert "need 2 replicas with kv_cache_dtype=auto" in out
    assert (
        main(
            [
                "kv-plan",
                "--model",
                llama3_8b,
                "--gpu-mem",
                "80",
                "--context",
                "8192",
                "--concurrency",
                "64",
                "--kv-cache-dtype",
                "int8",
            ]
        )
        == 0
    )
    assert "fit in one replica with kv_cache_dtype=int8" in capsys.readouterr().out
    assert (
        main(["kv-plan", "--model", llama3_8b, "--gpu-mem", "10", "--context", "8192", "--concurrency", "1"]) == 1
    )  # weights alone exceed 90 % of 10 GiB
    out = capsys.readouterr().out
    assert "does not fit" in out and "leave no room for a KV block" in out


def test_quantized_plan_names_its_scales_and_refuses_blocks_wider_than_a_head(llama3_8b, capsys):
    model = ModelConfig.from_dir(llama3_8b)
    # head_dim 128: the V extra row holds 128 bytes per head, one scale per token of a block
    assert plan_kv(model, 80, 8192, 1, kv_cache_dtype="int8", block_size=128).bytes_per_block == 32 * 2 * 129 * 8 * 128
    with pytest.raises(ValueError, match="block_size 256 must be at most head_dim 128"):
        plan_kv(model, 80, 8192, 1, kv_cache_dtype="fp8", block_size=256)
    plan_kv(model, 80, 8192, 1, kv_cache_dtype="auto", block_size=256)  # full precision: any size
    main(
        [
            "kv-plan",
            "--model",
            llama3_8b,
            "--gpu-mem",
            "80",
            "--context",
            "8192",
            "--concurrency",
            "1",
            "--kv-cache-dtype",
            "int8",
        ]
    )
    out = capsys.readouterr().out
    assert "int8/fp8 scales: K per channel with an fp8 offset (asymmetric), V per token" in out


def test_tensor_parallel_divides_weights_and_kv_heads_per_gpu(llama3_8b):
    model = ModelConfig.from_dir(llama3_8b)
    one = plan_kv(model, 24, 8192, 64)
    two = plan_kv(model, 24, 8192, 64, tensor_parallel_size=2)
    assert two.kv_heads_per_gpu == 4 and two.bytes_per_token * 2 == one.bytes_per_token
    # every sharded matrix halves; the norms (2 per layer + the final one) stay whole on each GPU
    norms = (2 * model.num_layers + 1) * model.hidden_size
    assert (two.weight_bytes // 2 - norms) * 2 == one.weight_bytes // 2 - norms
    assert two.num_blocks == two.kv_budget_bytes // two.bytes_per_block
    assert two.gpus_needed == 2 * two.replicas_needed
    eight = plan_kv(model, 24, 8192, 64, tensor_parallel_size=8)
    assert eight.kv_heads_per_gpu == 1
    sixteen = plan_kv(model, 24, 8192, 64, tensor_parallel_size=16)  # more ranks than KV heads: replicated
    assert sixteen.kv_heads_per_gpu == 1 and sixteen.bytes_per_block == eight.bytes_per_block
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 32 attention heads"):
        plan_kv(model, 24, 8192, 64, tensor_parallel_size=3)


def test_cli_tp_table_names_the_replicas_and_gpus_a_target_needs(llama3_8b, capsys):
    argv = ["kv-plan", "--model", llama3_8b, "--gpu-mem", "24", "--context", "8192", "--concurrency", "64"]
    assert main([*argv, "--tp", "2"]) == 1
    out = capsys.readouterr().out
    assert "tensor parallel 2 (4 KV heads per GPU)" in out
    assert "need 3 replicas of tp 2 (6 GPUs)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:4].strip() in {"1", "2", "4", "8"}}
    assert set(rows) == {"1", "2", "4", "8"}
    fewest = next(line for line in out.splitlines() if line.endswith("<- fewest GPUs"))
    assert fewest.split()[0] == "4" and fewest.split()[5:7] == ["1", "4"]  # one replica of tp 4: 4 GPUs
    assert main([*argv, "--tp", "3"]) == 2
    assert "must divide the model's 32 attention heads" in capsys.readouterr().err
