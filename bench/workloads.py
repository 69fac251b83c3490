"""Synthetic serving workloads (random, shared-prefix, multi-turn): a compatibility entry. They
are the product's load generator's own, ``deploy/ops/loadgen/workloads.py``; this keeps
``from bench.workloads import ...`` working for the benchmarks here."""

from deploy.ops.loadgen.workloads import (
    DATASETS,
    Conversation,
    DatasetName,
    Prompt,
    PromptMaker,
    Workload,
    WorkloadSpec,
    build_workload,
    ideal_prefix_hit_rate,
)

__all__ = [
    "DATASETS",
    "Conversation",
    "DatasetName",
    "Prompt",
    "PromptMaker",
    "Workload",
    "WorkloadSpec",
    "build_workload",
    "ideal_prefix_hit_rate",
]
