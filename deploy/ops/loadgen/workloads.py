"""Synthetic serving workloads for the load generator (``pdserve bench``): random, shared-prefix and
multi-turn.

Every workload is a pure function of its ``WorkloadSpec`` (seed included), so two runs against
two servers send byte-identical prompts. Prompts are space-separated words. With a tokenizer the
words are ones that encode to exactly one token (bare and after a space), so a prompt of N words
is N tokens, checked by encoding it; without one, a word counts as one token, which is close for
common English words under BPE vocabularies but not exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

DatasetName = Literal["random", "shared-prefix", "multi-turn"]
DATASETS: tuple[str, ...] = ("random", "shared-prefix", "multi-turn")

# Short common words: one token each, with a leading space, in the usual BPE vocabularies.
_FALLBACK_WORDS = tuple(
    dict.fromkeys(
        """
the of and to in is was for on that with as by at from his her it an are be this which or
have had not but one all were they she when there can more been its who would will also no
time two may into than some could other only new first these any then what has out about up
over such so after most years year made people world day back water long way much many state
part work city home area life day name place house war end form line head hand light story
point music game book food river power team field road field small great high old large right
long good little own best great young early late open full sure real true free clear close
""".split()
    )
)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Lengths are in tokens; ``output_len`` (when set) overrides every
    dataset's own output length."""

    dataset: DatasetName = "random"
    seed: int = 0
    num_prompts: int = 1000
    output_len: int | None = None
    tokenizer: str | None = None  # HF tokenizer dir: exact prompt lengths
    block_size: int = 16  # granularity of the ideal prefix-cache hit rate
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    mt_num_conversations: int = 32
    mt_turns: int = 4
    mt_user_len: int = 128
    mt_output_len: int = 128

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset {self.dataset!r} is unknown: use one of {', '.join(DATASETS)}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(
                f"random_range_ratio {self.random_range_ratio} must be in [0, 1): "
                "lengths are drawn from [len*(1-r), len*(1+r)]"
            )
        positive = {
            "num_prompts": self.num_prompts,
            "block_size": self.block_size,
            "random_input_len": self.random_input_len,
            "random_output_len": self.random_output_len,
            "gsp_num_groups": self.gsp_num_groups,
            "gsp_prompts_per_group": self.gsp_prompts_per_group,
            "gsp_system_prompt_len": self.gsp_system_prompt_len,
            "gsp_question_len": self.gsp_question_len,
            "gsp_output_len": self.gsp_output_len,
            "mt_num_conversations": self.mt_num_conversations,
            "mt_turns": self.mt_turns,
            "mt_user_len": self.mt_user_len,
            "mt_output_len": self.mt_output_len,
        }
        if self.output_len is not None:
            positive["output_len"] = self.output_len
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} is {value}: pass --{name.replace('_', '-')} of at least 1")


@dataclass(frozen=True)
class Prompt:
    """One single-turn request. ``system`` (shared-prefix only) precedes ``text``: as the system
    message on the chat endpoint, as the start of the prompt string on completions."""

    text: str
    prompt_len: int  # system + text, in tokens (approximate without a tokenizer)
    output_len: int
    system: str | None = None
    group: int | None = None

    def completion_prompt(self) -> str:
        return f"{self.system} {self.text}" if self.system else self.text

    def chat_messages(self) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return messages + [{"role": "user", "content": self.text}]


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat: turn k sends every earlier message plus ``user_turns[k]``."""

    user_turns: tuple[str, ...]
    user_lens: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class Workload:
    dataset: DatasetName
    prompts: tuple[Prompt, ...] = ()
    conversations: tuple[Conversation, ...] = ()
    ideal_cache_hit_rate: float | None = None  # shared-prefix only

    @property
    def num_requests(self) -> int:
        return len(self.prompts) + sum(len(c.user_turns) for c in self.conversations)


class PromptMaker:
    """Builds prompts of a given token length from a seeded generator."""

    def __init__(self, tokenizer_dir: str | None = None) -> None:
        self.tokenizer: Any = None
        self.words: tuple[str, ...] = _FALLBACK_WORDS
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer  # heavy: only when asked for

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            self.words = _single_token_words(self.tokenizer)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def make(self, rng: np.random.Generator, num_tokens: int) -> tuple[str, int]:
        """Text of ``num_tokens`` tokens (approximately, without a tokenizer) and its count."""
        picks = rng.integers(0, len(self.words), size=num_tokens)
        text = " ".join(self.words[i] for i in picks)
        if self.tokenizer is None:
            return text, num_tokens
        return text, self.count(text)

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _single_token_words(tokenizer: Any) -> tuple[str, ...]:
    """Alphabetic vocabulary entries that are one token both bare and after a space, so that
    joining N of them with spaces gives N tokens."""
    words = set()
    for token_id in range(len(tokenizer)):
        word = tokenizer.decode([token_id]).strip()
        if len(word) < 2 or not word.isascii() or not word.isalpha() or word in words:
            continue
        if (
            len(tokenizer.encode(word, add_special_tokens=False)) == 1
            and len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1
        ):
            words.add(word)
        if len(words) >= 4096:
            break
    if len(words) < 16:
        raise ValueError(
            f"tokenizer has only {len(words)} single-token words: prompts of exact "
            "lengths need a larger vocabulary; drop --tokenizer to use approximate lengths"
        )
    return tuple(sorted(words))


def ideal_prefix_hit_rate(
    num_groups: int, prompts_per_group: int, system_len: int, question_len: int, block_size: int
) -> float:
    """Fraction of prompt tokens a perfect block-granular prefix cache serves: every prompt but
    the first of its group reuses the system prompt's full blocks."""
    cached = num_groups * (prompts_per_group - 1) * (system_len // block_size) * block_size
    total = num_groups * prompts_per_group * (system_len + question_len)
    return cached / total


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    low = max(1, int(np.floor(mean * (1 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def build_workload(spec: WorkloadSpec, maker: PromptMaker | None = None) -> Workload:
    maker = maker or PromptMaker(spec.tokenizer)
    rng = np.random.default_rng(spec.seed)
    if spec.dataset == "random":
        return _random(spec, maker, rng)
    if spec.dataset == "shared-prefix":
        return _shared_prefix(spec, maker, rng)
    return _multi_turn(spec, maker, rng)


def _random(spec: WorkloadSpec, maker: PromptMaker, rng: np.random.Generator) -> Workload:
    input_lens = _lengths(rng, spec.random_input_len, spec.random_range_ratio, spec.num_prompts)
    output_lens = _lengths(rng, spec.random_output_len, spec.random_range_ratio, spec.num_prompts)
    prompts = []
    for input_len, output_len in zip(input_lens, output_lens):
        text, prompt_len = maker.make(rng, int(input_len))
        prompts.append(Prompt(text, prompt_len, spec.output_len or int(output_len)))
    return Workload("random", prompts=tuple(prompts))


def _shared_prefix(spec: WorkloadSpec, maker: PromptMaker, rng: np.random.Generator) -> Workload:
    output_len = spec.output_len or spec.gsp_output_len
    prompts = []
    for group in range(spec.gsp_num_groups):
        system, system_len = maker.make(rng, spec.gsp_system_prompt_len)
        for _ in range(spec.gsp_prompts_per_group):
            question, question_len = maker.make(rng, spec.gsp_question_len)
            prompts.append(Prompt(question, system_len + question_len, output_len, system, group))
    order = rng.permutation(len(prompts))  # interleave the groups
    ideal = ideal_prefix_hit_rate(
        spec.gsp_num_groups,
        spec.gsp_prompts_per_group,
        spec.gsp_system_prompt_len,
        spec.gsp_question_len,
        spec.block_size,
    )
    return Workload("shared-prefix", prompts=tuple(prompts[i] for i in order), ideal_cache_hit_rate=ideal)


def _multi_turn(spec: WorkloadSpec, maker: PromptMaker, rng: np.random.Generator) -> Workload:
    conversations = []
    for _ in range(spec.mt_num_conversations):
        turns = [maker.make(rng, spec.mt_user_len) for _ in range(spec.mt_turns)]
        conversations.append(
            Conversation(tuple(t for t, _ in turns), tuple(n for _, n in turns), spec.output_len or spec.mt_output_len)
        )
    return Workload("multi-turn", conversations=tuple(conversations))
