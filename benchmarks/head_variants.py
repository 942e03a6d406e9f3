"""What holds SmolLM2's EAGLE-3 head back: its size or what it reads? The bundled head fine-tuned
as it is (the control) beside variants of it, the same steps on the same batches: `two-layers`
(a second decoder layer appended, its output projections zero: at step 0 it computes what the
head does), `two-layers-random` (the same layer at its default random start) and `final-state`
(fc also reads the target's final hidden state beside its three layers', those columns zero at
the start). Then each is teacher-forced over SmolLM2's greedy answers to held-out chat prompts:
how often the first draft is the target's token, and the chain's tau at K = 1..4 (drafting after
every answer position from the target's states, as after a verify). The variants are probes: the
engine's chain and the checkpoint format hold one layer over three target layers. Not a test; CI
does not run it.

    python benchmarks/head_variants.py --hidden-states DIR [DIR ...]
        [--variants two-layers,final-state,two-layers-random] [--head DIR] [--steps 600]
        [--k 2] [--lr 5e-4] [--num-prompts 16] [--out runs/head_variants]

Writes <out>/result.json; each variant's checkpoint and loss log in <out>/<variant>/ (a rerun
resumes them).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch
from torch import nn

from head_certainty import answered       # benchmarks/, this script's directory
from specserve.methods import eagle3
from specserve.models.catalogue import resolve_model
from specserve.models.llama import DecoderLayer
from specserve.models.loader import load_model
from specserve.train.heads import state_loss
from specserve.train.states import read_hidden_states, state_batches
from specserve.train.trainer import TrainConfig, train

K_MAX = 4


def _deep_forward(self, token_ids, h, positions, md, cache, mask=None):
    """Eagle3Head.forward, then the appended layers; in an unrolled training pass each appended
    layer keeps its own list of earlier passes' keys and values beside layer 0's `cache`."""
    emb = self.embed_tokens(token_ids)
    cos_sin = self.rotary.tables(positions, emb.dtype)
    out = self.layers[0](emb, h, cos_sin, md, cache, mask)
    if len(cache) == 1:                      # layer 0 just stored pass 0: a new unrolling
        self.extra_cache = [[] for _ in self.extra]
    for layer, earlier in zip(self.extra, self.extra_cache):
        out = layer(out, cos_sin, md, earlier, mask)
    return out


def two_layers(head: eagle3.Eagle3Head, zero: bool = True) -> eagle3.Eagle3Head:
    """`head` with one plain decoder layer of its shape appended, its o_proj and down_proj
    zero (the residual branch adds nothing until trained) or, without `zero`, at their
    default random start (the function moves, the new layer's gradients are not small)."""
    layer = DecoderLayer(head.args)
    if zero:
        nn.init.zeros_(layer.self_attn.o_proj.weight)
        nn.init.zeros_(layer.mlp.down_proj.weight)
    head.extra = nn.ModuleList([layer])
    head.forward = types.MethodType(_deep_forward, head)
    return head


def final_state(head: eagle3.Eagle3Head) -> eagle3.Eagle3Head:
    """`head` whose fc also reads the target's final hidden state (after its three layers'),
    through new columns that start at zero."""
    old = head.fc.weight.detach()                                         # [H, 3 H_target]
    head.fc = nn.Linear(old.shape[1] + old.shape[1] // 3, old.shape[0], bias=False)
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([old, old.new_zeros(old.shape[0], old.shape[1] // 3)], 1))
    head.reads_final = True
    return head


VARIANTS = {"two-layers": two_layers, "final-state": final_state,
            "two-layers-random": lambda head: two_layers(head, zero=False)}


def held_out(target, target_dir: Path, aux_layers, num_prompts: int, max_tokens: int):
    """Per held-out chat prompt (pools base and more): token ids [1, S], positions, aux
    states, final hidden states, the target's greedy next token per position [S] and the
    prompt length."""
    with torch.no_grad():
        return [(ids, pos, aux, h, target.compute_logits(h)[0].argmax(-1), n_prompt)
                for ids, pos, h, aux, n_prompt in answered(
                    target_dir, target, aux_layers, "heldout", ["base", "more"], num_prompts,
                    max_tokens)]


def _reads(head, aux: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The target states `head`'s fc takes: its three layers' [.., 3H], and with a
    final-state variant the final hidden state after them [.., 4H]."""
    return torch.cat([aux, hidden], -1) if getattr(head, "reads_final", False) else aux


@torch.no_grad()
def evaluate(head, rows) -> dict:
    """First-draft accuracy and tau at K = 1..K_MAX, teacher-forced, over answer positions."""
    head.eval()
    accepted = []                          # per chain start: leading drafts right (<= K_MAX)
    for ids, pos, aux, hidden, greedy, n_prompt in rows:
        outs = eagle3.unrolled_drafts(head, ids, _reads(head, aux, hidden), pos, K_MAX)
        # row t of pass j drafts token t + j + 2, the target's greedy token at t + j + 1
        right = [head.to_target_ids(head.draft_logits(o).argmax(-1))[0]
                 == greedy[j + 1:j + 1 + o.shape[1]] for j, o in enumerate(outs)]
        for t in range(max(0, n_prompt - 2), ids.shape[1] - K_MAX - 1):
            n = 0
            while n < K_MAX and bool(right[n][t]):
                n += 1
            accepted.append(n)
    head.train()
    total = len(accepted)
    return {"positions": total,
            "first_draft": sum(a >= 1 for a in accepted) / total,
            "tau": {k: 1 + sum(min(a, k) for a in accepted) / total
                    for k in range(1, K_MAX + 1)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    p.add_argument("--hidden-states", nargs="+", required=True)
    p.add_argument("--variants", default="two-layers,final-state",
                   help=f"besides the control, from {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--k", type=int, default=2, help="unrolled draft steps in training")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts per pool")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/head_variants")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    target_dir = Path(resolve_model(a.target))
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    for q in target.parameters():
        q.requires_grad_(False)
    states, layers = read_hidden_states([Path(d) for d in a.hidden_states], torch.bfloat16)
    rows = None
    result = {"command": "python benchmarks/head_variants.py " + " ".join(sys.argv[1:]),
              "variants": {}}
    for name in ["control"] + [v for v in a.variants.split(",") if v]:
        head = eagle3.read(resolve_model(a.head), target).float()
        if name != "control":
            head = VARIANTS[name](head)
        head.mask_hidden = None                # the chain alone (a P-EAGLE head's mask unused)
        head.aux_layers = layers
        if rows is None:
            rows = held_out(target, target_dir, tuple(layers), a.num_prompts, a.max_tokens)
            result["start"] = evaluate(head, rows)
            print("start", json.dumps(result["start"]), flush=True)
        cfg = TrainConfig(work_dir=str(out / name), steps=a.steps, batch_size=8, seq_len=128,
                          lr=a.lr, warmup=20, threads=a.threads, device="cpu", bf16=False,
                          eval_every=10 ** 9)
        batch = state_batches(states, cfg, torch.device("cpu"))

        def batches(step: int, head=head, batch=batch) -> dict[str, torch.Tensor]:
            b = batch(step)
            return b | {"aux_hidden": _reads(head, b["aux_hidden"], b["hidden"])}
        log = train(head, None, cfg, torch.device("cpu"),
                    state_loss("eagle3", head, target, a.k), batches=batches)
        r = evaluate(head, rows)
        r["kl_last_50"] = sum(e["kl"] for e in log[-50:]) / len(log[-50:])
        r["params"] = sum(q.numel() for q in head.parameters() if q.requires_grad)
        result["variants"][name] = r
        print(name, json.dumps(r), flush=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
