"""extract_hidden_states: not a drafter. While requests run it keeps the target's hidden states
(the inputs of chosen layers, and the final normed state) of every position whose KV it
computed, and when a request finishes it writes them with the token ids to
`<hidden_states_dir>/<request id>.safetensors`, so that heads can be trained on served traffic
(`specserve train eagle3 --hidden-states DIR`).

A file holds `token_ids` [n + 1] (int64), `aux_hidden` [n, len(layers) * H] and `hidden`
[n, H] (float32): row t is the state after token t, the one that predicts token t + 1. Its
metadata names the layers and the target. A file is written under a temporary name and renamed
(never half written); writing stops once the directory's files reach `hidden_states_max_bytes`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.config import SpeculativeConfig
from specserve.methods.base import DraftContext, MethodSpec, Proposal, ProposeBatch, ProposerBase
from specserve.methods.eagle3 import default_aux_layers

logger = logging.getLogger("specserve")


class HiddenStateWriter(ProposerBase):
    reuses_prefix = False           # a file holds the states of every position

    def __init__(self, config: SpeculativeConfig, ctx: DraftContext) -> None:
        if not config.hidden_states_dir:
            raise ValueError("extract_hidden_states needs 'hidden_states_dir': the directory "
                             "to write the hidden states to")
        L = ctx.num_target_layers
        layers = tuple(config.hidden_states_layers or default_aux_layers(L))
        if not all(isinstance(x, int) and 0 <= x < L for x in layers):
            raise ValueError(f"hidden_states_layers must be target layers in [0, {L}), got "
                             f"{list(layers)}")
        self.aux_hidden_layers = layers
        self.dir = Path(config.hidden_states_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = config.hidden_states_max_bytes
        self.written = sum(f.stat().st_size for f in self.dir.glob("*.safetensors"))
        self.metadata = {"layers": json.dumps(list(layers)), "target": ctx.target_path}
        # request id -> rows of the positions computed so far: [(aux [n, F], hidden [n, H])]
        self.rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # requests that finished this step: the engine calls finish() before the step's
        # propose(), which still brings their last rows
        self.done: list = []
        self.num_files = 0

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        out = batch.runner_output
        for i, r in enumerate(batch.step_requests):
            lo, hi = out.rows(i, r.num_computed_tokens)      # the positions now in the cache
            if hi > lo:
                self.rows.setdefault(r.request_id, []).append(
                    (out.aux_hidden[lo:hi].float().cpu(), out.hidden[lo:hi].float().cpu()))
        for request in self.done:
            self._write(request)
        self.done = []
        return [Proposal([]) for _ in batch.requests]

    def finish(self, request) -> None:
        if request.finish_reason in ("stop", "length"):
            self.done.append(request)
        else:                                   # aborted or failed: nothing worth keeping
            self.rows.pop(request.request_id, None)

    def _write(self, request) -> None:
        rows = self.rows.pop(request.request_id, None)
        if not rows or self.written >= self.max_bytes:
            return
        aux = torch.cat([a for a, _ in rows])                            # [n, F]
        hidden = torch.cat([h for _, h in rows])                         # [n, H]
        n = len(hidden)
        tokens = torch.tensor(request.all_token_ids[:n + 1], dtype=torch.long)
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in request.request_id)
        path = self.dir / f"{name}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({"token_ids": tokens, "aux_hidden": aux, "hidden": hidden}, str(tmp),
                  metadata=self.metadata)
        os.replace(tmp, path)                  # atomic: readers never see half a file
        self.written += path.stat().st_size
        self.num_files += 1
        if self.written >= self.max_bytes:
            logger.warning("extract_hidden_states: %s holds %d bytes (hidden_states_max_bytes); "
                           "no more files are written", self.dir, self.written)

    def stats(self) -> dict[str, int]:
        return {"hidden_state_files": self.num_files, "hidden_state_bytes": self.written}


SPEC = MethodSpec(
    name="extract_hidden_states", build=HiddenStateWriter, in_benchmarks=False,
    summary="no drafts: write the target's hidden states of finished requests for training",
    keys=("hidden_states_dir", "hidden_states_layers", "hidden_states_max_bytes"),
    default_k=lambda _path: 1, model_is_target=True)
