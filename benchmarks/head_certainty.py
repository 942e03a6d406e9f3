"""How often an EAGLE-3 head's first draft is the target's greedy token, by how sure the target
is of that token: over SmolLM2's own greedy answers to held-out chat prompts, teacher-forced
(the head drafts after every position from the target's states, as the chain's first step
does after a verify). Says where acceptance is lost: on the tokens the target itself is unsure
of, or on the ones it is sure of. Prints a table; not a test.

    python benchmarks/head_certainty.py [--head smollm2-135m-instruct-eagle3] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.data.chat_prompts import POOLS, chat_prompts
from specserve.methods import eagle3
from specserve.models.catalogue import resolve_model
from specserve.models.loader import load_model

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0001)


@torch.inference_mode()
def answered(target_dir: Path, target, aux_layers: tuple[int, ...], split: str,
             pools: list[str], num_prompts: int, max_tokens: int) -> list[tuple]:
    """The target's greedy answers to the first `num_prompts` chat prompts of `split` in each
    pool, through its chat template, and its pass over each conversation: per conversation
    (ids [1, S], positions [1, S], final hidden states [1, S, H], the inputs of `aux_layers`
    [1, S, n H], the prompt's length)."""
    llm = LLM(str(target_dir), device="cpu", dtype="float32")
    messages = [[{"role": "user", "content": q}] for pool in pools
                for q in chat_prompts(split, pool=pool)[:num_prompts]]
    outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens),
                    use_tqdm=False)
    rows = []
    for o in outs:
        ids = torch.tensor([list(o.prompt_token_ids) + list(o.outputs[0].token_ids)])
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        h, aux = target(ids, pos, aux_layers=aux_layers)
        rows.append((ids, pos, h, aux, len(o.prompt_token_ids)))
    return rows


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--split", choices=("heldout", "train"), default="heldout",
                   help="train: prompts the head was trained on, to tell capacity from overfitting")
    p.add_argument("--pool", choices=POOLS, default="base",
                   help="the prompt pool (data/chat_prompts.py)")
    a = p.parse_args()
    target_dir = Path(resolve_model(a.target))
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    head = eagle3.read(resolve_model(a.head), target).float().eval()
    rows = answered(target_dir, target, tuple(head.aux_layers), a.split, [a.pool],
                    a.num_prompts, a.max_tokens)
    vocab = torch.zeros(target.args.vocab_size, dtype=torch.bool)
    vocab[head.draft_to_target()] = True                  # what the head can draft at all
    sure, hit, can = [], [], []      # per answer position: p(top-1), first draft right, in vocab
    for ids, pos, h, aux, n_prompt in rows:
        logp = target.compute_logits(h).float().log_softmax(-1)               # [1, S, V]
        first = eagle3.unrolled_drafts(head, ids, aux, pos, 1)[0]             # [1, S - 1, H]
        drafts = head.to_target_ids(head.draft_logits(first).argmax(-1))[0]   # [S - 1]
        # row t drafts token t + 2, which the target predicts at position t + 1
        greedy = logp[0, 1:].argmax(-1)                                       # [S - 1]
        top1 = logp[0, 1:].max(-1).values.exp()
        answer = slice(n_prompt - 2, -1)            # rows whose token t + 2 is the answer's
        sure += top1[answer].tolist()
        hit += (drafts[answer] == greedy[answer]).tolist()
        can += vocab[greedy[answer]].tolist()
    n = len(sure)
    print(f"{a.head} on {a.target}: {n} answer positions of {len(rows)} {a.pool} {a.split} "
          f"chat answers, first draft = target's greedy token {sum(hit) / n:.1%}")
    print("| target's p(top-1) | share of tokens | first draft right | token in the draft "
          "vocabulary |")
    print("|---|---:|---:|---:|")
    for lo, hi in zip(EDGES, EDGES[1:]):
        rows = [(h, c) for s, h, c in zip(sure, hit, can) if lo <= s < hi]
        if rows:
            print(f"| {lo:.2f}-{min(hi, 1):.2f} | {len(rows) / n:.1%} | "
                  f"{sum(h for h, _ in rows) / len(rows):.1%} | "
                  f"{sum(c for _, c in rows) / len(rows):.1%} |")


if __name__ == "__main__":
    main()
