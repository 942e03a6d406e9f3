"""`specserve train chat-data`: a chat model's own answers and hidden states, the training set
of its drafters (as EAGLE-3 and the speculators project train: on the target's outputs).

The prompts (`data/chat_prompts.py`, train split): templated instructions over a topic list,
questions the target writes itself about each topic, and code tasks from the standard library
(`--prompt-pool more` / `extra`: a second or third pool of new topics and kinds of request
instead).
Each is answered through the target's chat template, greedy and sampled (temperature 0.7), in
batches; `extract_hidden_states` writes each answered conversation's token ids and the hidden
states a head trains on (`specserve train eagle3 --hidden-states OUT/states`), and
`answers.jsonl` keeps the text. Batches are done in turn, each finished batch's files moved to
`states/batch-NNNNN/` under a DONE marker: a run stopped anywhere resumes where it was, and a
larger --num-prompts answers only what is new.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from specserve.data.chat_prompts import POOLS, chat_prompts, held_out, question_requests
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


@dataclass
class ChatDataConfig:
    num_prompts: int | None = field(default=None, metadata={
        "help": "train-split prompts to answer (default: all of them)"})
    answer_temperatures: str = field(default="0,0.7", metadata={
        "help": "comma-separated: every prompt is answered once at each"})
    answer_max_tokens: int = field(default=256, metadata={"help": "longest answer"})
    answer_batch_size: int = field(default=16, metadata={"help": "conversations per engine batch"})
    states_max_bytes: int = field(default=16 << 30, metadata={
        "help": "the most bytes of hidden states OUT/states may hold; a run that reaches it "
                "stops, keeping its finished batches"})
    answer_seed: int = field(default=0, metadata={"help": "seed of the sampled answers"})
    prompt_pool: str = field(default="base", metadata={
        "help": "base: the templated prompts, code tasks and the target's own questions; more: "
                "a second pool of new topics and kinds of request; extra: a third, with problems "
                "with numbers and standard-library method tasks (data/chat_prompts.py)"})

    def temps(self) -> list[float]:
        return [float(t) for t in self.answer_temperatures.split(",") if t.strip()]


def _written_questions(llm: LLM, out: Path, max_tokens: int) -> list[str]:
    """Questions the target writes about each topic (once; kept in questions.json)."""
    path = out / "questions.json"
    if path.is_file():
        return json.loads(path.read_text())
    outs = llm.chat([[{"role": "user", "content": r}] for r in question_requests()],
                    SamplingParams(temperature=0, max_tokens=min(64, max_tokens)), use_tqdm=False)
    questions = [o.outputs[0].text.strip().split("\n")[0].strip() for o in outs]
    questions = [q for q in questions if q.endswith("?") and not held_out(q)]
    path.write_text(json.dumps(questions, indent=1))
    return questions


def _answered(done_dir: Path) -> list[tuple[str, float]]:
    """The (prompt, temperature) jobs a finished batch answered (a run with another
    --num-prompts cuts its last batch differently: that batch is answered again)."""
    lines = (done_dir / "answers.jsonl").read_text().splitlines()
    return [(a["prompt"], a["temperature"]) for a in map(json.loads, lines)]


def generate_chat_data(target: str, out: Path, cfg: ChatDataConfig) -> dict:
    """Answer the train split's prompts with `target`, writing hidden states and answers to
    `out` (resumable); returns a summary (also written to out/summary.json)."""
    if cfg.prompt_pool not in POOLS:          # before the target is loaded
        raise ValueError(f"--prompt-pool must be one of {', '.join(POOLS)}, "
                         f"got {cfg.prompt_pool!r}")
    out.mkdir(parents=True, exist_ok=True)
    staging = out / "staging"
    shutil.rmtree(staging, ignore_errors=True)          # a stopped batch's leftovers
    states = out / "states"
    kept = sum(f.stat().st_size for f in states.rglob("*.safetensors"))   # of earlier runs
    llm = LLM(target, speculative_config={
        "method": "extract_hidden_states", "hidden_states_dir": str(staging),
        "hidden_states_max_bytes": max(0, cfg.states_max_bytes - kept)})
    prompts = (chat_prompts("train") + _written_questions(llm, out, cfg.answer_max_tokens)
               if cfg.prompt_pool == "base" else chat_prompts("train", pool=cfg.prompt_pool))
    random.Random(cfg.answer_seed).shuffle(prompts)       # kinds mixed in any first N
    shutil.rmtree(staging, ignore_errors=True)           # the question requests' states
    staging.mkdir()
    if cfg.num_prompts is not None:
        prompts = prompts[:cfg.num_prompts]
    jobs = [(p, t) for p in prompts for t in cfg.temps()]
    size = cfg.answer_batch_size
    batches = [jobs[i:i + size] for i in range(0, len(jobs), size)]
    bar = tqdm(total=len(batches), desc="chat data", unit="batch")
    for b, batch in enumerate(batches):
        done_dir = states / f"batch-{b:05d}"
        if (done_dir / "DONE").is_file() and _answered(done_dir) == batch:
            bar.update(1)
            continue
        params = [SamplingParams(temperature=t, max_tokens=cfg.answer_max_tokens,
                                 seed=cfg.answer_seed * 1_000_003 + b * len(batch) + i)
                  for i, (_, t) in enumerate(batch)]
        outs = llm.chat([[{"role": "user", "content": p}] for p, _ in batch], params,
                        use_tqdm=False)
        written = len(list(staging.glob("*.safetensors")))
        if written < len(batch):        # the byte budget ran out: this batch is not done
            bar.close()
            raise RuntimeError(
                f"{states} reached --states-max-bytes {cfg.states_max_bytes} in batch {b} "
                f"({written} of its {len(batch)} conversations' states written); the {b} "
                "batches before it are kept: raise --states-max-bytes (or free disk) and run "
                "again to go on")
        shutil.rmtree(done_dir, ignore_errors=True)
        done_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(done_dir)
        staging.mkdir()
        with open(done_dir / "answers.jsonl", "w") as f:
            for (p, t), o in zip(batch, outs):
                f.write(json.dumps({"prompt": p, "temperature": t, "answer": o.outputs[0].text,
                                    "tokens": len(o.outputs[0].token_ids)}) + "\n")
        (done_dir / "DONE").write_text("")
        bar.update(1)
    bar.close()
    files = list(states.rglob("*.safetensors"))
    answers = [json.loads(line) for f in sorted(states.rglob("answers.jsonl"))
               for line in f.read_text().splitlines()]
    summary = {"target": target, "conversations": len(answers),
               "answer_tokens": sum(a["tokens"] for a in answers),
               "hidden_state_files": len(files),
               "hidden_state_bytes": sum(f.stat().st_size for f in files),
               "prompts": len(prompts), "temperatures": cfg.temps(),
               "max_tokens": cfg.answer_max_tokens,
               "heldout_prompts": len(chat_prompts("heldout", pool=cfg.prompt_pool))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
