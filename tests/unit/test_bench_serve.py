"""The serving load generator (deploy/ops/loadgen, ``pdserve bench``) against a fake
OpenAI-compatible server on loopback (FastAPI + uvicorn in a thread) that streams a known number
of chunks with known delays, reports usage with cached_tokens, and refuses every Nth request
with 429."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deploy.ops.loadgen import CHAT, BenchConfig, main, run_benchmark
from deploy.ops.loadgen.workloads import WorkloadSpec, build_workload, ideal_prefix_hit_rate

FIRST_DELAY_S = 0.03
CHUNK_DELAY_S = 0.01


class FakeServer:
    """Replies with `fake_chunks` chunks (default 4) whose texts name the request (`r{n}c{i} `),
    usage completion_tokens = chunks + 1 (so a test can tell usage from counting chunks),
    prompt_tokens = words in the prompt, cached_tokens = prompt_tokens // 2."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.replies: list[str] = []
        self.refuse_every = 0
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.generate)
        self.app.post("/v1/chat/completions")(self.generate)

    def reset(self, refuse_every: int = 0) -> None:
        with self.lock:
            self.received, self.replies, self.refuse_every = [], [], refuse_every

    async def models(self):
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def generate(self, request: Request):
        body = await request.json()
        with self.lock:
            self.received.append(body)
            n = len(self.received)
        if self.refuse_every and n % self.refuse_every == 0:
            return JSONResponse({"error": {"message": "queue full", "type": "overloaded"}}, status_code=429)
        chat = request.url.path.endswith("chat/completions")
        text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        prompt_tokens = len(text.split())
        chunks = body.get("fake_chunks", 4)
        pieces = [f"r{n}c{i} " for i in range(chunks)]
        with self.lock:
            self.replies.append("".join(pieces))

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            await asyncio.sleep(body.get("fake_delay_s", FIRST_DELAY_S))
            for i, piece in enumerate(pieces):
                if i:
                    await asyncio.sleep(CHUNK_DELAY_S)
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                yield sse({"id": f"cmpl-{n}", "choices": [choice]})
            if not body.get("fake_no_usage"):
                yield sse(
                    {
                        "id": f"cmpl-{n}",
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": chunks + 1,
                            "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2},
                        },
                    }
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_server():
    fake = FakeServer()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    server.should_exit = True
    thread.join(timeout=5)


def small_random(**kw) -> WorkloadSpec:
    return WorkloadSpec(**{"dataset": "random", "num_prompts": 8, "random_input_len": 20, "random_output_len": 4, **kw})


async def test_counts_refusals_usage_and_timings(fake_server):
    fake_server.reset(refuse_every=4)
    config = BenchConfig(
        workload=small_random(),
        base_url=fake_server.url + "/v1",
        max_concurrency=4,
        ignore_eos=True,
        goodput_slos_ms={"ttft": 10_000},
    )
    result = await run_benchmark(config)
    s = result.summary
    assert (s.completed, s.failed, s.refused) == (6, 2, 2)
    assert result.model == "fake-model"  # from GET /v1/models
    refused = [r for r in result.requests if not r.success]
    assert all(r.refused and r.status == 429 and r.error == "HTTP 429: queue full" for r in refused)
    ok = [r for r in result.requests if r.success]
    for r in ok:
        assert r.output_tokens == 5  # usage.completion_tokens wins over the 4 chunks counted
        assert len(r.itl_s) == 3  # chunks - 1
        assert FIRST_DELAY_S <= r.ttft_s < r.e2el_s
        # Gaps are not compared with the server's sleeps: under load the chunks arrive together.
        assert all(gap >= 0 for gap in r.itl_s)
        assert sum(r.itl_s) <= r.e2el_s - r.ttft_s + 1e-9  # the gaps lie between first chunk and end
        assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 4)
        assert r.prompt_tokens == 20 and r.cached_tokens == 10
    assert s.total_output_tokens == 30 and s.total_input_tokens == 120
    assert s.cached_tokens == 60 and s.cache_hit_rate == 0.5 and s.ideal_cache_hit_rate is None
    assert s.request_goodput == pytest.approx(6 / s.duration_s)
    sent = fake_server.received[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (sent["model"], sent["max_tokens"], sent["temperature"]) == ("fake-model", 4, 0.0)
    assert sent["ignore_eos"] is True
    assert len(sent["prompt"].split()) == 20


async def test_without_usage_counts_chunks_and_extra_body_is_merged(fake_server):
    fake_server.reset()
    config = BenchConfig(
        workload=small_random(num_prompts=3),
        base_url=fake_server.url,
        model="m",
        extra_body={"fake_no_usage": True, "fake_chunks": 6, "cache_salt": "x"},
    )
    result = await run_benchmark(config)
    assert [r.output_tokens for r in result.requests] == [6, 6, 6]
    assert all(len(r.itl_s) == 5 and r.cached_tokens is None for r in result.requests)
    assert result.summary.cached_tokens is None and result.summary.cache_hit_rate is None
    assert result.summary.total_input_tokens == 60  # the workload's counts, lacking usage
    assert all(b["cache_salt"] == "x" and b["model"] == "m" for b in fake_server.received)


async def test_timeouts_and_empty_streams_fail_without_stopping_the_run(fake_server):
    fake_server.reset()
    slow = BenchConfig(
        workload=small_random(num_prompts=2),
        base_url=fake_server.url,
        model="m",
        timeout_s=0.2,
        extra_body={"fake_delay_s": 5},
    )
    result = await run_benchmark(slow)  # the server would answer after 5 s: only the timeout fails them
    assert [r.error for r in result.requests] == ["timed out after 0.2s"] * 2
    assert (result.summary.failed, result.summary.refused) == (2, 0)
    empty = BenchConfig(
        workload=small_random(num_prompts=2), base_url=fake_server.url, model="m", extra_body={"fake_chunks": 0}
    )
    result = await run_benchmark(empty)
    assert [r.error for r in result.requests] == ["stream ended without content"] * 2


def test_ideal_hit_rate_is_exact():
    # 2 groups x 4 prompts, system 40 tokens -> 32 cacheable (2 blocks of 16), question 10:
    # 2 * 3 * 32 cached of 2 * 4 * 50 prompt tokens.
    assert ideal_prefix_hit_rate(2, 4, 40, 10, 16) == 192 / 400
    spec = WorkloadSpec(
        dataset="shared-prefix",
        gsp_num_groups=2,
        gsp_prompts_per_group=4,
        gsp_system_prompt_len=40,
        gsp_question_len=10,
        gsp_output_len=3,
    )
    workload = build_workload(spec)
    assert workload.ideal_cache_hit_rate == 0.48
    assert len(workload.prompts) == 8 and all(p.prompt_len == 50 for p in workload.prompts)
    systems = {p.group: p.system for p in workload.prompts}
    assert len(set(systems.values())) == 2
    assert all(p.system == systems[p.group] for p in workload.prompts)
    assert [p.group for p in workload.prompts] != sorted(p.group for p in workload.prompts)  # interleaved


@pytest.mark.parametrize("dataset", ["random", "shared-prefix", "multi-turn"])
def test_workloads_are_deterministic_in_the_seed(dataset):
    spec = dict(
        dataset=dataset,
        num_prompts=5,
        random_input_len=30,
        random_range_ratio=0.5,
        gsp_num_groups=2,
        gsp_prompts_per_group=3,
        gsp_system_prompt_len=20,
        mt_num_conversations=2,
        mt_turns=2,
    )
    assert build_workload(WorkloadSpec(seed=1, **spec)) == build_workload(WorkloadSpec(seed=1, **spec))
    assert build_workload(WorkloadSpec(seed=1, **spec)) != build_workload(WorkloadSpec(seed=2, **spec))


def test_random_lengths_follow_the_range_ratio():
    workload = build_workload(
        WorkloadSpec(num_prompts=50, random_input_len=100, random_output_len=10, random_range_ratio=0.5)
    )
    assert all(50 <= p.prompt_len <= 150 and 5 <= p.output_len <= 15 for p in workload.prompts)
    assert all(len(p.text.split()) == p.prompt_len for p in workload.prompts)


async def test_multi_turn_resends_history_with_the_replies_received(fake_server):
    fake_server.reset()
    spec = WorkloadSpec(dataset="multi-turn", mt_num_conversations=3, mt_turns=3, mt_user_len=5, mt_output_len=4)
    config = BenchConfig(workload=spec, base_url=fake_server.url, max_concurrency=2)
    assert config.resolved_endpoint == CHAT
    result = await run_benchmark(config)
    workload = build_workload(spec)
    by_user_turn = {}
    for body, reply in zip(fake_server.received, fake_server.replies):
        assert body["max_completion_tokens"] == 4
        by_user_turn[body["messages"][-1]["content"]] = (body["messages"], reply)
    for conversation in workload.conversations:
        history = []
        for turn, user_text in enumerate(conversation.user_turns):
            messages, reply = by_user_turn[user_text]
            assert messages == history + [{"role": "user", "content": user_text}]
            assert len(messages) == 2 * turn + 1
            history = messages + [{"role": "assistant", "content": reply}]
    s = result.summary
    assert (s.completed, s.failed) == (9, 0)
    assert [(t.turn, t.completed) for t in s.per_turn] == [(1, 3), (2, 3), (3, 3)]
    # prompt words: 5, then 5 + 4 reply words + 5, ... (the fake counts words); cached is half.
    assert [t.mean_prompt_tokens for t in s.per_turn] == [5, 14, 23]
    assert [t.mean_cached_tokens for t in s.per_turn] == [2, 7, 11]
    assert all(t.mean_ttft_ms >= FIRST_DELAY_S * 1000 for t in s.per_turn)


def test_cli_prints_the_vllm_block_and_writes_json(fake_server, tmp_path, capsys):
    fake_server.reset(refuse_every=5)
    out = tmp_path / "result.json"
    rc = main(
        [
            "--base-url",
            fake_server.url,
            "--dataset",
            "shared-prefix",
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "4",
            "--gsp-system-prompt-len",
            "40",
            "--gsp-question-len",
            "10",
            "--gsp-output-len",
            "3",
            "--request-rate",
            "200",
            "--goodput",
            "ttft:10000",
            "tpot:10000",
            "--percentiles",
            "50,90,99",
            "--result-json",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    for header in (
        "============ Serving Benchmark Result ============",
        "---------------Time to First Token----------------",
        "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------",
        "----------------End-to-end Latency----------------",
        "Successful requests:                     7",
        "Failed requests:                         1",
        "Refused requests (429/503):              1",
        "Request goodput (req/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P90 TTFT (ms):",
        "P99 TTFT (ms):",
        "P95 ITL (ms):",
        "Max ITL (ms):",
        "Mean E2EL (ms):",
        "Ideal cache hit rate (%):                48.00",
        "Measured cache hit rate (%):",
    ):
        assert header in printed, header
    assert printed.rstrip().endswith("=" * 50)
    saved = json.loads(out.read_text())
    assert saved["model"] == "fake-model" and saved["summary"]["completed"] == 7
    assert saved["summary"]["ideal_cache_hit_rate"] == 0.48
    assert len(saved["requests"]["ttfts"]) == 8 and saved["config"]["request_rate"] == 200
    # completions prompts are the group's system prompt, a space, then the question
    assert len({" ".join(body["prompt"].split()[:40]) for body in fake_server.received}) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--goodput", "ttfx:5"], "goodput SLO ttfx:5.0 is invalid"),
        (["--dataset", "multi-turn", "--endpoint", "/v1/completions"], "multi-turn dataset sends message lists"),
        (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
        (["--random-range-ratio", "1.5"], "random_range_ratio 1.5 must be in [0, 1)"),
    ],
)
def test_cli_rejects_bad_options_with_what_to_change(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_reports_an_unreachable_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    assert main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--disable-tqdm"]) == 1


def test_tokenizer_gives_exact_prompt_lengths(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())  # byte-level, like GPT-2 / Llama 3 / Qwen
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [
        "the river ran past the old city and the young team sat by the water",
        "a game of music and light in the open field near the great house",
    ] * 20
    corpus += [word for line in corpus[:2] for word in line.split()] * 5  # bare words too
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    tokenizer.save_pretrained(tmp_path)
    spec = WorkloadSpec(
        dataset="shared-prefix",
        gsp_num_groups=2,
        gsp_prompts_per_group=2,
        gsp_system_prompt_len=37,
        gsp_question_len=9,
        tokenizer=str(tmp_path),
    )
    for prompt in build_workload(spec).prompts:
        assert len(tokenizer.encode(prompt.system, add_special_tokens=False)) == 37
        assert len(tokenizer.encode(prompt.completion_prompt(), add_special_tokens=False)) == 46
        assert prompt.prompt_len == 46
