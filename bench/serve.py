"""Serving benchmark for any OpenAI-compatible server (pdserve, vLLM, SGLang), like
``vllm bench serve``: the script form of ``pdserve bench``. The load generator is the product's
own, ``deploy/ops/loadgen/``; the benchmarks here import it from there.

    python bench/serve.py --dataset random --num-prompts 200 --request-rate 8
    python bench/serve.py --dataset shared-prefix --gsp-num-groups 8 --max-concurrency 16
    python bench/serve.py --dataset multi-turn --mt-turns 4 --result-json mt.json

The run is bounded: a fixed number of requests, each with a total timeout; failed requests are
counted (429/503 separately as refused) and never stop the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.ops.loadgen import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
