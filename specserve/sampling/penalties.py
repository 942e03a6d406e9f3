"""logit_bias and the presence, frequency and repetition penalties, applied to every verify row
with the counts of the tokens before that row, the drafts before it included: the row after
draft i sees the output as it would be had drafts 1..i been emitted, so that speculative
output equals non-speculative output under the same penalties (vLLM's definitions: presence
and frequency count output tokens, repetition also prompt tokens)."""

from __future__ import annotations

import torch

from specserve.sampling_params import SamplingParams


def needs_processing(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                    output: list[int], paths: list[list[int]]) -> None:
    """In place on one request's rows, logits [n, V]; paths[j]: the draft tokens before row j
    (row 0: none)."""
    n, V = logits.shape
    dev = logits.device
    counts = torch.zeros(n, V, device=dev)                                     # [n, V]
    if output:
        counts += torch.bincount(torch.tensor(output, device=dev), minlength=V)[:V]
    for j, path in enumerate(paths):
        if path:
            counts[j].index_add_(0, torch.tensor(path, device=dev),
                                 torch.ones(len(path), device=dev))
    if p.repetition_penalty != 1.0:
        seen = counts > 0                                                       # [n, V]
        if prompt:
            seen[:, torch.tensor(prompt, device=dev)] = True
        rp = p.repetition_penalty
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp),
                                 logits))
    if p.frequency_penalty:
        logits -= p.frequency_penalty * counts
    if p.presence_penalty:
        logits -= p.presence_penalty * (counts > 0).float()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=dev)
        logits[:, ids] += torch.tensor(list(p.logit_bias.values()), device=dev)
