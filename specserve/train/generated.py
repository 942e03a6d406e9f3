"""Text the target writes itself, mixed into the training text of drafts and heads.

A draft is judged by agreement with the target on the target's own trajectories; corpus text
alone teaches it the corpus. A greedy server verifies greedy trajectories, so continuations at
temperature 0 match what the draft will see there; sampled ones (the default, 0.7) cover more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specserve.data.corpus import Corpus, read_text
from specserve.inputs import TokensPrompt
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.train.bpe import EOS

OPENING_STRIDE = 2000          # characters between the openings taken from one file
MAX_OPENINGS_PER_FILE = 16


@dataclass
class GeneratedData:
    """The target-generated share of a draft's or head's training text."""
    num_generated: int = field(default=64, metadata={
        "help": "continuations the target writes from openings of training files"})
    generated_len: int = field(default=256, metadata={"help": "tokens per continuation"})
    generated_temperature: float = field(default=0.7, metadata={
        "help": "sampling temperature of the continuations (0 = greedy, the trajectories a "
                "greedy server verifies)"})
    generated_share: float = field(default=0.0, metadata={
        "help": "share of training tokens drawn from the continuations (repeated to reach it); "
                "0 appends them once"})

    def __post_init__(self) -> None:
        if self.num_generated < 0 or self.generated_len < 1 or self.generated_temperature < 0:
            raise ValueError("num_generated must be >= 0, generated_len >= 1 and "
                             "generated_temperature >= 0")
        if not 0 <= self.generated_share < 1:
            raise ValueError(f"generated_share must be in [0, 1), got {self.generated_share}")


def fit_prompts(llm, prompts: list[str], max_tokens: int) -> list:
    """Token prompts that leave room for `max_tokens` in the model's context (cut from the left)."""
    room = max(1, llm.engine.max_model_len - max_tokens - 1)
    return [TokensPrompt(prompt_token_ids=llm.get_tokenizer().encode(p)[-room:]) for p in prompts]


def corpus_openings(corpus: Corpus, num: int, seed: int) -> list[str]:
    """`num` openings (400 characters) of training files, in a seeded file order: each file's
    beginning first; past the number of files, pass p starts at the first line after character
    p * OPENING_STRIDE of each file long enough (distinct, unless files copy each other)."""
    order = np.random.default_rng(seed).permutation(len(corpus.train_files))
    openings: list[str] = []
    texts: dict[int, str] = {}                  # each file read once
    for p in range(MAX_OPENINGS_PER_FILE):
        for i in order:
            if i not in texts:
                texts[i] = read_text(corpus.train_files[i])
            text = texts[i]
            start = 0 if p == 0 else text.find("\n", p * OPENING_STRIDE) + 1
            if p == 0 or start > 0:
                text = text[start:start + 400]
                if text.strip():            # empty files (bare __init__.py) skipped
                    openings.append(text)
                    if len(openings) == num:
                        return openings
    return openings


def generated_tokens(target_dir: Path, corpus: Corpus, num: int, length: int, seed: int,
                     temperature: float = 0.7, skip: int = 0) -> np.ndarray:
    """Continuations the target writes from held-in corpus openings, prompt included: those
    of openings skip..num - 1."""
    if num <= skip:
        return np.zeros(0, dtype=np.int64)
    llm = LLM(str(target_dir), device="cpu", seed=seed)
    tok = llm.get_tokenizer()
    prompts = fit_prompts(llm, corpus_openings(corpus, num, seed)[skip:], length)
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=length,
                            ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=True)
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for o in outs:
        ids += o.prompt_token_ids + o.outputs[0].token_ids + [eos]
    return np.asarray(ids, dtype=np.int64)


def mix_generated(train_ids: np.ndarray, generated: np.ndarray, share: float) -> np.ndarray:
    """Corpus tokens followed by the generated ones, repeated until they make up about `share`
    of the whole (appended once when share is 0)."""
    reps = 1
    if share > 0 and len(generated):
        reps = max(1, math.ceil(share * len(train_ids) / ((1 - share) * len(generated))))
    return np.concatenate([train_ids.astype(np.int64)] + [generated] * reps)


def with_generated(train_ids: np.ndarray, gen: GeneratedData, target_dir: Path, corpus: Corpus,
                   work: Path, seed: int) -> np.ndarray:
    """`train_ids` mixed with the target's continuations (generated once, cached in `work`
    under a name that records the settings, so other settings regenerate). Greedy ones extend
    the largest smaller greedy cache of the same length there: openings come in a fixed order
    and a greedy continuation depends on its opening alone."""
    def cache(num: int | str) -> Path:
        return work / f"generated-{num}x{gen.generated_len}-t{gen.generated_temperature:g}.npy"

    path = cache(gen.num_generated)
    if not path.is_file():
        have = 0
        if gen.generated_temperature == 0:
            sizes = (int(f.name.split("-")[1].split("x")[0]) for f in work.glob(cache("*").name))
            have = max((n for n in sizes if n < gen.num_generated), default=0)
        head = np.load(cache(have)) if have else np.zeros(0, dtype=np.int64)
        np.save(path, np.concatenate([head, generated_tokens(
            target_dir, corpus, gen.num_generated, gen.generated_len, seed,
            gen.generated_temperature, skip=have)]))
    return mix_generated(train_ids, np.load(path), gen.generated_share)
