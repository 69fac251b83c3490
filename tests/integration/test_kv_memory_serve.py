"""KV memory levers through the product: an int8 KV cache served disaggregated (real Serve,
real gloo transfer of quantized blocks, real HTTP) and a sliding-window model past its window."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from ray import serve

from tests.integration.conftest import deploy, wait_idle
from tests.unit.engine_helpers import random_prompts
from workers.engine import LLMEngine, SamplingParams
from workers.models.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(600)
WINDOW = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kv-memory-models")
    # A copy under another name: its own model key, so its int8 pool does not meet the float32
    # pool of the same weights that other tests register in the shared Redis.
    int8_dir = shutil.copytree(tiny_llama, root / "llama-int8")
    swa_dir = make_tiny_model(root / "mistral-swa", arch="mistral", seed=1, sliding_window=WINDOW)
    return {"int8": str(int8_dir), "swa": str(swa_dir)}


@pytest.fixture(scope="module")
def apps(serve_cluster, models):
    common = {
        "redis_url": serve_cluster.redis.url,
        "num_kv_blocks": 128,
        "device": "cpu",
        "transfer_timeout_s": 10.0,
        "lease_ttl_s": 10.0,
        "prefill": {"replicas": 1, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
    }
    bases = {
        "int8": deploy(
            serve_cluster,
            "pd-int8",
            "/int8",
            {**common, "model": models["int8"], "served_model_name": "m", "kv_cache_dtype": "int8"},
        ),
        "swa": deploy(
            serve_cluster,
            "pd-swa",
            "/swa",
            {**common, "model": models["swa"], "served_model_name": "m", "num_kv_blocks": 24},
        ),
    }
    yield bases
    for base in bases.values():
        wait_idle(base)
    for name in ("pd-int8", "pd-swa"):  # the session's cluster has CPUs for the next modules' apps
        serve.delete(name)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def test_int8_disaggregated_equals_int8_colocated_engine(apps, models):
    prompts = random_prompts((9, 70, 150), seed=61)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(models["int8"], kv_cache_dtype="int8", num_kv_blocks=128, load_progress=False).generate(
        prompts, params
    )
    c = client(apps["int8"])
    for prompt, want in zip(prompts, expected):
        out = c.completions.create(
            model="m", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == want.text
    status = wait_idle(apps["int8"])
    (decode,) = status["pools"]["decode"]
    (prefill,) = status["pools"]["prefill"]
    # Every prompt's blocks crossed the pair group as int8 blocks (17 rows of 1-byte elements).
    cfg = LLMEngine(models["int8"], kv_cache_dtype="int8", num_kv_blocks=1, load_progress=False).kv_layout
    assert cfg.dtype == "int8" and decode["transfers"] == len(prompts)
    assert (
        decode["transfer_bytes"]
        == prefill["transfer_bytes"]
        == cfg.bytes_per_block * sum(-(-len(p) // 16) for p in prompts)
    )


def test_sliding_window_model_serves_past_three_windows_in_a_small_cache(apps, models):
    # 24 blocks x 16 = 384 tokens per replica; a 150-token prompt + 200 new tokens would not fit
    # two at once without the window. Four concurrent requests do. (The engine equals
    # transformers on this model past three windows: tests/unit/test_sliding_window.py.)
    prompts = random_prompts((150, 120, 90, 60), seed=62)
    expected = LLMEngine(models["swa"], num_kv_blocks=64, load_progress=False).generate(
        prompts, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    )
    c = client(apps["swa"])

    def run(prompt):
        return c.completions.create(
            model="m", prompt=prompt, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
        )

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(run, prompts))
    for out, want in zip(outs, expected):
        assert out.usage.completion_tokens == 200
        assert out.choices[0].text == want.text
    assert client(apps["swa"]).models.list().data[0].model_extra["max_model_len"] > WINDOW
