"""GPU truth in one pass (``scripts/gpu-check`` runs it): each check adds rows to one summary table.

    python bench/gpu_check.py [--skip tests transfer prompt agreement roofline memory] [--model M] [--log-dir D]

- ``tests``: ``pytest tests/gpu`` (pass/fail counts; the whole output in ``--log-dir``).
- ``transfer``: ``bench/transfer.py --device cuda`` (KV blocks between two processes: NCCL with
  two GPUs, else gloo staged through pinned host memory) against a plain device->host->device
  copy of the same bytes through pinned memory in one process; the pull's cost of block
  checksums, and the Triton checksum kernel against the torch definition.
- ``prompt``: the Triton prompt-attention kernel (``workers/backends/cuda/triton_prefill.py``) on
  an 8B-shaped layer against SDPA with the chunk's mask, a 2,048-token chunk after 30k cached
  tokens timed with its peak memory, and whether SDPA's flash kernel takes a fresh GQA prompt.
- ``agreement``: SmolLM2-135M-Instruct in bf16 on the GPU, the engine (eager and compiled)
  against transformers' greedy ``generate``: identical completions and identical tokens.
  ``--model`` takes a directory or a GGUF file where the package index cannot be reached.
- ``memory``: the engine's memory plan on the device: an 8B-shaped model with random bf16
  weights at the default utilization, a 32k-token prompt, then 64 prompts of 2k tokens at once;
  the plan's line and the peak allocated memory against its budget.
- ``roofline``: decode step time of an 8B-shaped model with random weights (32 layers, hidden
  4096, 32/8 heads, MLP 14336, vocab 128256, bf16) at batch 1/16/64 with 2048 tokens of
  context each, eager and compiled (CUDA graphs between the attention ops), against the HBM
  roofline: (weight bytes + the step's KV bytes) / 4.8 TB/s (H200). Eager and compiled use
  the engine's CUDA choice (SDPA over gathered blocks; flash-attn's paged kernel when installed
  and the block size suits it); two more eager rows per batch run the paged backend (its decode
  kernel: hand-written Triton on CUDA, ``workers/backends/cuda/triton_paged.py``) and flex; "compiled-
  paged" is the compiled step over the paged kernel. Each row names its backend. Each backend
  is built and timed in a process of its own, one after another, eager first (two compiled
  models in one process interfered: call 4 in BENCHMARKS.md), and one that fails is a row: the
  rest still run.

First run on an H200 (torch 2.11.0+cu130) on 2026-12-04: BENCHMARKS.md, "GPU check", holds what it
printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HBM_BYTES_PER_S = 4.8e12  # H200
ROWS: list[tuple[str, str, str]] = []  # (check, case, result)


_AS_CHILD = False  # --roofline-child: rows go to the parent as JSON lines


def row(check: str, case: str, result: str) -> None:
    if _AS_CHILD:
        print("ROW\t" + json.dumps([check, case, result]), flush=True)
        return
    ROWS.append((check, case, result))
    print(f"  {check:<12} {case:<40} {result}", flush=True)


def check_tests(timeout_s: int, log_dir: Path | None) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-s", "tests/gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if log_dir is not None:
        (log_dir / "tests-gpu.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = proc.stdout.strip().splitlines() or ["(no output)"]
    for line in lines:  # the summary's outcome lines (-rA) and the tests' own printed figures
        if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED")) or "parity" in line or "agreement" in line:
            print(f"    {line}"[:300], flush=True)
    row("tests/gpu", f"rc {proc.returncode}, {time.monotonic() - started:.0f} s", lines[-1])


def check_transfer(sizes_mib: list[int], reps: int, log_dir: Path | None) -> None:
    """KV pull between two processes (bench/transfer.py) against a plain pinned round trip."""
    out = Path(tempfile.mkdtemp()) / "transfer.json"
    cmd = [sys.executable, str(ROOT / "bench" / "transfer.py"), "--device", "cuda", "--no-object-store"]
    cmd += ["--sizes-mib", *map(str, sizes_mib), "--reps", str(reps), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    if log_dir is not None:
        (log_dir / "transfer.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        row("KV transfer", "FAILED", f"rc {proc.returncode}: {tail}"[:300])
        return
    result = json.loads(out.read_text())
    device = torch.device("cuda:0")
    for r in result["rows"]:
        nbytes = r["size_mib"] << 20
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        back = torch.empty_like(src)
        times = []
        for i in range(reps + 1):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            host.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            back.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t)
        assert torch.equal(back, src)
        times.sort()
        copy_gbps = nbytes / times[len(times) // 2] / 1e9
        kv_gbps, raw_gbps = r["kv_gbps"], r["raw_gbps"]
        row(
            "KV transfer",
            f"{result['transport']} {r['size_mib']} MiB ({r['blocks']} blocks)",
            f"{kv_gbps:.2f} GB/s; raw {result['transport'].split('_')[0]} send/recv {raw_gbps:.2f}; "
            f"pinned D2H+H2D copy {copy_gbps:.2f} GB/s; kv/copy {kv_gbps / copy_gbps:.2f}; "
            f"block checksums {r['kv_s'] / r['kv_plain_s'] - 1:+.1%} of the pull without them",
        )
    check_checksum_kernel(max(sizes_mib), reps)


def check_checksum_kernel(size_mib: int, reps: int) -> None:
    """The block checksums' Triton kernel on a wire buffer: equal to the torch definition, and its rate."""
    from workers.backends.cuda import triton_checksum
    from workers.transfer import checksum

    device = torch.device("cuda:0")
    words = torch.randint(-(2**62), 2**62, (32, 2, size_mib * 4, 512), dtype=torch.int64, device=device)  # 4 KiB chunks
    expected = checksum.reference_sums(words)
    got = triton_checksum.block_sums(words)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        triton_checksum.block_sums(words)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    median = sorted(times[1:])[len(times[1:]) // 2]
    row(
        "KV checksum",
        f"Triton, {words.nbytes >> 20} MiB",
        f"{'equal to' if torch.equal(got, expected) else 'DIFFERS from'} the torch definition; "
        f"{words.nbytes / median / 1e9:.0f} GB/s",
    )


def check_prompt_attention(reps: int = 5) -> None:
    """The Triton prompt kernel on an 8B-shaped layer (32 query heads, 8 KV heads, 128, bf16,
    16-token blocks): equal to SDPA with the chunk's mask on a small case, then a 2,048-token chunk
    after 30k cached tokens timed with its peak memory; and whether SDPA's flash kernel takes a
    fresh GQA prompt (causal, no mask), which the backend leaves on SDPA."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from workers.backends.cuda import triton_prefill

    device, dtype, hq, hkv, d, bs = torch.device("cuda:0"), torch.bfloat16, 32, 8, 128, 16

    def case(cached: int, n: int) -> tuple:
        context = cached + n
        blocks = -(-context // bs)
        k = torch.randn(blocks + 8, bs, hkv, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        table = torch.randperm(blocks + 8, device=device)[:blocks]
        q = torch.randn(n, hq, d, device=device, dtype=dtype)
        return q, k, v, table, context

    q, k, v, table, context = case(4096, 512)
    got = triton_prefill.paged_prefill(q, k, v, table, 0, context, d**-0.5, None)
    keys = k[table].flatten(0, 1)[:context].transpose(0, 1)[None]  # [1, Hkv, L, D]
    values = v[table].flatten(0, 1)[:context].transpose(0, 1)[None]
    qpos = torch.arange(context - 512, context, device=device)
    mask = qpos[:, None] >= torch.arange(context, device=device)[None, :]
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True)
    err = (got.float() - want[0].transpose(0, 1).float()).abs().max().item()
    q, k, v, table, context = case(30720, 2048)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        triton_prefill.paged_prefill(q, k, v, table, 0, context, d**-0.5, None)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    median = sorted(times[1:])[len(times[1:]) // 2]
    flops = 4 * hq * d * 2048 * (30720 + 1024)  # q.k and p.v over the keys each query sees
    extra = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    row(
        "prompt attention",
        "Triton, 2,048 after 30,720 (bf16)",
        f"max |diff| vs masked SDPA {err:.3g} (512 after 4,096); {median * 1e3:.2f} ms, "
        f"{flops / median / 1e12:.0f} TFLOP/s; {extra:.0f} MiB beyond its inputs",
    )
    fq = torch.randn(1, hq, 4096, d, device=device, dtype=dtype)
    fk = torch.randn(1, hkv, 4096, d, device=device, dtype=dtype)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(fq, fk, fk, is_causal=True, enable_gqa=True)
        verdict = "taken by the flash kernel"
    except RuntimeError as exc:
        verdict = f"NOT taken by the flash kernel: {str(exc).splitlines()[0][:120]}"
    row("prompt attention", "fresh 4,096-token GQA prompt, SDPA causal", verdict)


def check_agreement(new_tokens: int, model: str, device: str = "cuda") -> None:
    from transformers import AutoModelForCausalLM

    from tests.conftest import CHAT_QUESTIONS, chat_prompt_ids
    from workers.engine import LLMEngine, SamplingParams
    from workers.models.source import resolve_model

    model_dir = str(resolve_model(model))
    prompts = [chat_prompt_ids(model_dir, q) for q in CHAT_QUESTIONS]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    # (dtype, eager): bf16 as served on GPUs, eager and compiled; fp32 eager, which should be exact
    for dtype_name, runs in (("bfloat16", (True, False)), ("float32", (True,))):
        dtype = getattr(torch, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        expected = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p], device=device)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
                expected.append(out[0, len(p) :].tolist())
        del hf
        for eager in runs:
            engine = LLMEngine(
                model_dir,
                device=device,
                dtype=dtype_name,
                num_kv_blocks=512,
                max_num_seqs=8,
                load_progress=False,
                enforce_eager=eager,
                compile_batch_sizes=None if eager else (8,),
            )
            outs = [o.token_ids for o in engine.generate(prompts, params)]
            same = sum(o == e for o, e in zip(outs, expected))
            tokens = sum(sum(a == b for a, b in zip(o, e)) for o, e in zip(outs, expected))
            total = sum(len(e) for e in expected)
            row(
                f"{'bf16' if dtype_name == 'bfloat16' else 'fp32'} greedy",
                f"SmolLM2 {'eager' if eager else 'compiled'} vs transformers",
                f"{same}/{len(prompts)} completions identical, {tokens}/{total} tokens at equal positions",
            )
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()


SHAPE_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
SHAPE_SMOKE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}  # --smoke: the code path on CPU, in seconds


def _model_dir(root: Path, shape: dict, max_positions: int = 8192) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ROOFLINE_BACKENDS = ("eager", "compiled", "paged", "flex", "compiled-paged")


def check_roofline(
    batches: list[int], context: int, steps: int, smoke: bool = False, backends: tuple[str, ...] = ROOFLINE_BACKENDS
) -> None:
    from workers.engine.compiled import CompiledDecode
    from workers.engine.model_runner import ModelRunner
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.scheduler import ScheduledSeq, SchedulerOutput
    from workers.engine.sequence import Sequence
    from workers.layers.kv_cache import PagedKVCache
    from workers.models.config import ModelConfig
    from workers.models.llama import LlamaForCausalLM

    device = torch.device("cpu" if smoke else "cuda")
    dtype, block_size = torch.bfloat16, 16
    model_dir = _model_dir(Path(tempfile.mkdtemp()) / "llama-shape", SHAPE_SMOKE if smoke else SHAPE_8B)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, context + 1)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb.build(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks_per_seq = -(-context // block_size)
    kv = PagedKVCache(cfg, max(batches) * blocks_per_seq + 1, block_size, "auto", dtype, device)
    kv_bytes_per_token = cfg.kv_bytes_per_token(2)
    steps_of = {}
    for batch in batches:
        seqs = []
        for i in range(batch):
            seq = Sequence(
                request_id=f"s{i}",
                prompt_token_ids=[1] * context,
                params=SamplingParams(max_tokens=2),
                arrival_time=0.0,
            )
            seq.block_table = list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
            seq.num_computed_tokens = context - 1
            seqs.append(seq)
        steps_of[batch] = SchedulerOutput(decodes=[ScheduledSeq(s, 1) for s in seqs], prefills=[], num_preempted=0)

    def backend_for(attention: str):
        from workers import backends
        from workers.engine.config import EngineConfig

        config = EngineConfig(model_dir=str(model_dir), device=str(device), attention_backend=attention)
        return backends.select("auto", device, config)

    def build(name: str):
        if name.startswith("compiled"):  # "compiled": SDPA attention; "compiled-paged": paged
            compiled = CompiledDecode(model, max(batches), device, tuple(batches))
            attention = name.partition("-")[2] or "sdpa"
            return ModelRunner(model, kv, backend_for(attention), compiled=compiled)  # compiles every bucket
        if name == "eager":
            return ModelRunner(model, kv, backend_for("sdpa"))
        return ModelRunner(model, kv, backend_for(name))

    # One backend at a time, eager first: a backend that fails to build or run is a row, and
    # every row already measured has been printed.
    for name in backends:
        started = time.monotonic()
        try:
            runner = build(name)
        except Exception as e:  # noqa: BLE001 - a backend that cannot build is a row, not the end
            row("8B decode", f"build {name}", f"FAILED: {type(e).__name__}: {e}"[:300])
            continue
        if runner.attention_backend == "sdpa":
            backend = "flash-attn paged" if "Flash" in repr(runner._attention) else "SDPA over gathered blocks"
        else:
            backend = f"{runner.attention_backend} attention"
        if name != "eager":
            compiled = name.startswith("compiled") and device.type == "cuda"
            what = "CUDA graphs per bucket" if compiled else "kernels"
            row("8B decode", f"build {name} ({what})", f"{time.monotonic() - started:.0f} s, buckets {batches}")
        for batch in batches:
            step = steps_of[batch]
            roofline_ms = (weight_bytes + batch * context * kv_bytes_per_token) / HBM_BYTES_PER_S * 1e3
            try:
                for _ in range(3):
                    runner.execute(step)
                _sync(device)
                t = time.perf_counter()
                for _ in range(steps):
                    runner.execute(step)
                _sync(device)
            except Exception as e:  # noqa: BLE001
                row("8B decode", f"batch {batch} {name} ({backend})", f"FAILED: {type(e).__name__}: {e}"[:300])
                continue
            ms = (time.perf_counter() - t) / steps * 1e3
            row(
                "8B decode",
                f"batch {batch} ctx {context} {name} ({backend})",
                f"{ms:.2f} ms/step; roofline {roofline_ms:.2f} ms; {roofline_ms / ms:.0%} of HBM peak",
            )
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()


def check_memory(long_prompt: int, concurrency: int, each: int, smoke: bool = False) -> None:
    """The engine's memory plan on the device (workers/engine/memory_plan.py): an 8B-shaped model
    with random bf16 weights (``load_format="dummy"``) at the default utilization, then a
    ``long_prompt``-token prompt and ``concurrency`` prompts of ``each`` tokens at once; the
    peak allocated memory against the plan's budget."""
    from workers.engine import LLMEngine, SamplingParams
    from workers.models.tiny import _save_tokenizer

    device = "cpu" if smoke else "cuda"
    shape = SHAPE_SMOKE if smoke else SHAPE_8B
    model_dir = _model_dir(Path(tempfile.mkdtemp()) / "llama-8b-shape", shape, long_prompt + 64)
    _save_tokenizer(512, model_dir)  # ids only: the engine's tokenizer is not asked to decode here
    started = time.monotonic()
    engine = LLMEngine(
        str(model_dir),
        device=device,
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=long_prompt + 64,
        max_num_batched_tokens=8192,
        load_progress=False,
        **({"kv_cache_memory_gib": 0.05} if smoke else {}),
    )
    plan = engine.memory_plan
    assert plan is not None
    row("memory", "plan", f"{plan.line()} ({time.monotonic() - started:.0f} s to build)")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    for what, prompts in (
        (f"1 prompt of {long_prompt} tokens", [torch.randint(0, vocab, (long_prompt,), generator=gen).tolist()]),
        (
            f"{concurrency} prompts of {each} tokens at once",
            [torch.randint(0, vocab, (each,), generator=gen).tolist() for _ in range(concurrency)],
        ),
    ):
        t = time.monotonic()
        try:
            outs = engine.generate(prompts, params)
        except Exception as e:  # noqa: BLE001 - an out-of-memory is this check's finding
            row("memory", what, f"FAILED: {type(e).__name__}: {e}"[:300])
            continue
        assert all(len(o.token_ids) == 8 for o in outs)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        within = "within" if peak <= plan.budget_bytes else "OVER"
        row(
            "memory",
            what,
            f"{time.monotonic() - t:.1f} s; peak allocated {peak / 2**30:.2f} GiB, {within} the plan's "
            f"budget {plan.budget_bytes / 2**30:.2f} GiB",
        )
    engine.check_idle()
    row("memory", "disaggregated on one GPU over CUDA IPC", "not built yet: KV moves through the host (gloo)")


def roofline_in_children(batches: list[int], context: int, steps: int, backends: list[str], smoke: bool) -> None:
    """Each backend in a process of its own: two CompiledDecode on one model in one process
    share dynamo's cache entries and CUDA-graph trees, and the second one timed 2.5x slower
    than alone (BENCHMARKS.md, "GPU check", call 4). Rows stream back as they are measured."""
    for name in backends:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--roofline-child", name, "--steps", str(steps)]
        cmd += ["--batches", *map(str, batches), "--context", str(context)] + (["--smoke"] if smoke else [])
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None
        rows = 0
        for line in proc.stdout:
            if line.startswith("ROW\t"):
                row(*json.loads(line[4:]))
                rows += 1
        err = proc.stderr.read()
        if proc.wait() != 0:
            tail = " | ".join(err.strip().splitlines()[-2:])
            row("8B decode", f"{name} process", f"FAILED: rc {proc.returncode}: {tail}"[:300])
        elif rows == 0:
            row("8B decode", f"{name} process", "no rows")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=("tests", "transfer", "prompt", "agreement", "roofline", "memory")
    )
    ap.add_argument("--long-prompt", type=int, default=32768, help="memory: the long prompt's tokens")
    ap.add_argument("--concurrency", type=int, default=64, help="memory: prompts at once")
    ap.add_argument("--each", type=int, default=2048, help="memory: tokens of each concurrent prompt")
    ap.add_argument("--model", default="smollm2", help="agreement: a known name, a directory or a GGUF file")
    ap.add_argument("--log-dir", type=Path, help="write the tests' and the transfer's whole output here")
    ap.add_argument("--transfer-sizes-mib", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--tests-timeout-s", type=int, default=180)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backends", nargs="+", default=list(ROOFLINE_BACKENDS), choices=ROOFLINE_BACKENDS)
    ap.add_argument("--smoke", action="store_true", help="roofline code path only, tiny shape, on CPU")
    ap.add_argument("--roofline-child", choices=ROOFLINE_BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.roofline_child:  # one backend's rows, as JSON lines the parent reads
        global _AS_CHILD
        _AS_CHILD = True
        batches, context, steps = ([1, 2], 64, 2) if args.smoke else (args.batches, args.context, args.steps)
        check_roofline(batches, context, steps, smoke=args.smoke, backends=(args.roofline_child,))
        return 0
    if args.smoke:
        roofline_in_children([1, 2], 64, 2, args.backends, smoke=True)
        check_memory(256, 4, 64, smoke=True)
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing to measure", file=sys.stderr)
        return 2
    print(f"# gpu-check on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    checks = {
        "tests": lambda: check_tests(args.tests_timeout_s, args.log_dir),
        "transfer": lambda: check_transfer(args.transfer_sizes_mib, 3, args.log_dir),
        "prompt": lambda: check_prompt_attention(),
        "agreement": lambda: check_agreement(args.new_tokens, args.model),
        "roofline": lambda: roofline_in_children(args.batches, args.context, args.steps, args.backends, smoke=False),
        "memory": lambda: check_memory(args.long_prompt, args.concurrency, args.each),
    }
    for name, check in checks.items():
        if name in args.skip:
            continue
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others' rows
            row(name, "FAILED", f"{type(exc).__name__}: {exc}"[:200])
    width = max(len(c) for c, _, _ in ROWS) if ROWS else 10
    case_width = max(len(c) for _, c, _ in ROWS) if ROWS else 10
    print("\n| check | case | result |\n|---|---|---|")
    for what, case, result in ROWS:
        print(f"| {what:<{width}} | {case:<{case_width}} | {result} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
