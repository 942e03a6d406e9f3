"""How much of a target's answers an EAGLE-3 draft vocabulary of each size can propose: the N
tokens most frequent in the answers of the first 90% of a `specserve train chat-data` set's
prompts, as a share of the answer tokens of the other 10% (held out by prompt; greedy and
temperature-0.7 answers apart). A draft outside its vocabulary is never accepted, so this is a
ceiling on the head's acceptance at each position. Not a test; CI does not run it.

    python benchmarks/draft_vocab_coverage.py [--data runs/smollm2-chat-data]
        [--target smollm2-135m-instruct] [--sizes 1024,2048,4096,8192,16384]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from specserve.models.catalogue import resolve_model
from specserve.models.loader import load_tokenizer


def coverage(data: Path, target: str, sizes: list[int], heldout: float = 0.1) -> dict:
    tok = load_tokenizer(resolve_model(target))
    answers = [json.loads(line) for f in sorted(data.glob("states/batch-*/answers.jsonl"))
               for line in f.read_text().splitlines()]
    prompts = sorted({a["prompt"] for a in answers})
    held = set(prompts[int(len(prompts) * (1 - heldout)):])
    train: collections.Counter = collections.Counter()
    test: dict[float, collections.Counter] = collections.defaultdict(collections.Counter)
    for a in answers:
        ids = tok.encode(a["answer"])
        (test[a["temperature"]] if a["prompt"] in held else train).update(ids)
    ranked = [t for t, _ in train.most_common()]
    out = {"train_answer_tokens": sum(train.values()), "distinct_train_tokens": len(ranked),
           "heldout_prompts": len(held), "coverage": {}}
    for temp, counts in sorted(test.items()):
        n = sum(counts.values())
        out["coverage"][f"temperature {temp}"] = {"answer_tokens": n, **{
            str(size): round(sum(counts[t] for t in ranked[:size]) / n, 4) for size in sizes}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="runs/smollm2-chat-data")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    a = p.parse_args()
    print(json.dumps(coverage(Path(a.data), a.target, [int(s) for s in a.sizes.split(",")]),
                     indent=1))


if __name__ == "__main__":
    main()
