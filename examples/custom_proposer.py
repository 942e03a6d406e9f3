"""A proposer of your own, plugged in by its import path (`method: custom_class`).

This one drafts from a dictionary of known completions: when a request's prompt is a key, it
proposes the next K tokens of the stored completion for as long as the output follows it
(a cache of answers, say). Run from the repository root:

    PYTHONPATH=examples python examples/custom_proposer.py
    PYTHONPATH=examples specserve generate models/code-target --prompt "def add(a, b):" \\
        --speculative-config '{"model": "custom_proposer.DictionaryProposer",
                               "num_speculative_tokens": 4}'

The class is built as `cls(config, ctx)` (SpeculativeConfig, DraftContext) and implements the
Proposer protocol; ProposerBase supplies the members it does not need (no KV cache, no target
hidden states). Whatever it drafts, verification keeps the output exactly the target's.
"""

from __future__ import annotations

from specserve.methods.base import DraftContext, Proposal, ProposeBatch, ProposerBase
from specserve.tokenizer import Tokenizer

# prompt -> its known completion; edit, or fill it from past answers
COMPLETIONS: dict[str, str] = {
    "def add(a, b):": "\n    return a + b\n",
}


class DictionaryProposer(ProposerBase):
    def __init__(self, config, ctx: DraftContext) -> None:
        tok = Tokenizer(ctx.target_path)
        # prompt token ids -> completion token ids, tokenized with the target's tokenizer
        self.known = {tuple(tok.encode(p)): tok.encode(p + c)[len(tok.encode(p)):]
                      for p, c in COMPLETIONS.items()}
        self.hits = 0

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        out = []
        for r, k in zip(batch.requests, batch.max_num_tokens):
            prompt = tuple(r.all_token_ids[:r.num_prompt_tokens])
            done = r.all_token_ids[r.num_prompt_tokens:]
            known = self.known.get(prompt, [])
            drafts = known[len(done):len(done) + k] if known[:len(done)] == done else []
            self.hits += bool(drafts)
            out.append(Proposal(drafts))
        return out

    def stats(self) -> dict[str, int]:
        return {"dictionary_drafts": self.hits}


def main() -> None:
    import custom_proposer      # the module the engine imports (this script runs as __main__)

    from specserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=48)
    prompt = "def fibonacci(n):"
    # an answer given before becomes a known completion (a cache of past answers)
    custom_proposer.COMPLETIONS[prompt] = LLM("models/code-target", device="cpu").generate(
        prompt, params, use_tqdm=False)[0].outputs[0].text
    llm = LLM("models/code-target", device="cpu", speculative_config={
        "model": "custom_proposer.DictionaryProposer", "num_speculative_tokens": 4})
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    print(prompt + out.outputs[0].text)
    stats = llm.get_stats()
    print(f"mean acceptance length {stats['mean_acceptance_length']:.2f} "
          f"({stats['dictionary_drafts']} steps drafted from the dictionary)")


if __name__ == "__main__":
    main()
