"""OpenAI response bodies and stream chunks built from RequestOutputs."""

from __future__ import annotations

from collections.abc import Callable

from specserve.outputs import RequestOutput

Decode = Callable[[int], str]


def completion_logprobs(token_ids: list[int], lps: list[dict[int, float]] | None,
                        dec: Decode) -> dict | None:
    """The completions API's logprobs object for these tokens."""
    if lps is None:
        return None
    toks = token_ids[:len(lps)]
    return {"tokens": [dec(t) for t in toks],         # an echoed prompt's first entry is None
            "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(toks, lps)],
            "top_logprobs": [None if lp is None else {dec(k): v for k, v in lp.items()}
                             for lp in lps],
            "text_offset": []}


def chat_logprobs(token_ids: list[int], lps: list[dict[int, float]] | None,
                  dec: Decode) -> dict | None:
    """The chat API's logprobs object ({"content": [...]}) for these tokens."""
    if lps is None:
        return None
    def entry(t: int, lp: float) -> dict:
        s = dec(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return {"content": [entry(t, lp[t]) | {"top_logprobs": [entry(k, v) for k, v in lp.items()]}
                        for t, lp in zip(token_ids, lps)]}


def prompt_logprobs(o: RequestOutput, dec: Decode) -> list[dict | None]:
    """vLLM's prompt_logprobs of a choice: None for the first token, then for each prompt
    token {token id (a string): {logprob, decoded_token}} with the prompt's token and the top N."""
    return [None if lp is None else {str(t): {"logprob": v, "decoded_token": dec(t)}
                                     for t, v in lp.items()}
            for lp in o.prompt_logprobs or []]


def usage(outs: list[RequestOutput], samples_per_prompt: int = 1) -> dict:
    """outs: every sample drawn, prompt-major. A prompt's tokens count once however many
    samples it has (as OpenAI counts n); every sample's tokens count, best_of's dropped ones
    too, since they were computed."""
    firsts = outs[::samples_per_prompt]
    p = sum(len(o.prompt_token_ids) for o in firsts)
    c = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}}


def spec_metrics(out: RequestOutput) -> dict | None:
    s = out.spec_metrics
    if s is None:
        return None
    return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "accepted_per_position": s.num_accepted_tokens_per_pos,
            "acceptance_rate": s.acceptance_rate,
            "mean_acceptance_length": s.mean_acceptance_length}
