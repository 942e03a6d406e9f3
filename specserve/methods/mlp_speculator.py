"""IBM MLP speculator (Wertheimer et al. 2024, IBM format): staged MLPs over the target's last
hidden state and the previous token; stage i drafts token t+i+1."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import SpeculativeConfig
from specserve.methods.base import (
    DraftContext,
    MethodSpec,
    Proposal,
    ProposeBatch,
    ProposerBase,
)
from specserve.methods.checkpoints import assign_weights, check_target, write_head
from specserve.methods.heads_common import last_hidden_rows
from specserve.models.loader import load_hf_config, read_state_dict

INNER_DIM = 256         # the state width of trained speculators: its two vocab matrices dominate


class SpeculatorLayerNorm(nn.Module):
    """IBM's LayerNormParameterized without mean subtraction: x / rms(x) * weight + bias."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """Stage i: state = gelu(ln_i(proj_i(state) + c * emb_i(token))); logits = head_i(state)."""

    def __init__(self, emb_dim: int, inner_dim: int, vocab: int, n_predict: int,
                 tie_weights: bool = False, scale_input: bool = False) -> None:
        super().__init__()
        self.n_predict = n_predict
        n = 1 if tie_weights else n_predict
        self.emb = nn.ModuleList(nn.Embedding(vocab, inner_dim) for _ in range(n))
        self.proj = nn.ModuleList(
            [nn.Linear(emb_dim, inner_dim, bias=False)]
            + [nn.Linear(inner_dim, inner_dim, bias=False)
               for _ in range(min(1, n_predict - 1) if tie_weights else n_predict - 1)])
        self.head = nn.ModuleList(nn.Linear(inner_dim, vocab, bias=False) for _ in range(n))
        self.ln = nn.ModuleList(SpeculatorLayerNorm(inner_dim) for _ in range(n))
        self.ln0 = SpeculatorLayerNorm(emb_dim, affine=False) if scale_input else None
        state_weight = 0.5 ** (0.5 / n_predict)
        emb_weight = math.sqrt((1 - state_weight ** 2) * (inner_dim / 2))
        self.emb_scale = emb_weight / state_weight      # ln is scale-invariant: fold weights

    def stage(self, i: int, state: torch.Tensor, token_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """state: [B, emb_dim] (stage 0) or [B, inner]; token_ids: [B] -> (state, logits [B, V])."""
        e = min(i, len(self.emb) - 1)
        if i == 0 and self.ln0 is not None:
            state = self.ln0(state) / math.sqrt(2)
        state = self.proj[min(i, len(self.proj) - 1)](state) + self.emb[e](token_ids) * self.emb_scale
        state = F.gelu(self.ln[e](state))
        return state, self.head[e](state)


def new_head(target: nn.Module, k: int, draft_vocab: int | None = None,
             token_counts=None, inner_dim: int | None = None) -> MLPSpeculator:
    """Stages that share embedding and head (IBM's tie_weights); `inner_dim` sets the size (its
    two vocabulary matrices hold 2 x vocab x inner_dim parameters)."""
    a = target.args
    return MLPSpeculator(a.hidden_size, inner_dim or INNER_DIM, a.vocab_size, k,
                         tie_weights=True)


def read(path: str | Path, target: nn.Module) -> MLPSpeculator:
    d = Path(path)
    cfg = load_hf_config(d)
    src = str(d / "config.json")
    for key in ("emb_dim", "inner_dim", "n_predict", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"{src}: required key {key!r} is missing")
    check_target(src, "emb_dim", cfg["emb_dim"], target.args.hidden_size)
    check_target(src, "vocab_size", cfg["vocab_size"], target.args.vocab_size)
    inner = cfg["inner_dim"] or cfg["emb_dim"]
    spec = MLPSpeculator(cfg["emb_dim"], inner, cfg["vocab_size"], cfg["n_predict"],
                         bool(cfg.get("tie_weights")), bool(cfg.get("scale_input")))
    # IBM's fms-fsdp saves the speculator inside a wrapper: its tensors under `speculator.`
    state = {k.removeprefix("speculator."): v for k, v in read_state_dict(d).items()}
    assign_weights(spec, state, str(d))
    return spec


def write(head: MLPSpeculator, out: Path, target_dir: Path, dtype: torch.dtype) -> None:
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
           "emb_dim": head.proj[0].in_features, "inner_dim": head.proj[0].out_features,
           "n_predict": head.n_predict, "vocab_size": head.head[0].out_features,
           "tie_weights": len(head.emb) == 1, "scale_input": head.ln0 is not None}
    write_head(out, cfg, dict(head.state_dict()), dtype)


def loss(head: MLPSpeculator, x, pos, h, aux, logp, k: int, distill):
    """Stage i, teacher-forced with the true tokens, against the target at t+i+1."""
    S = x.shape[1]
    n = S - head.n_predict
    state, losses = h[:, :n], []
    for i in range(head.n_predict):
        state, logits = head.stage(i, state, x[:, i + 1:i + 1 + n])
        losses.append(distill(logits, logp[:, i + 1:i + 1 + n]))
    total = sum(losses) / len(losses)
    return total, {"loss": total.item(), "kl_stage0": losses[0].item()}


class MLPSpeculatorProposer(ProposerBase):
    def __init__(self, config: SpeculativeConfig, ctx: DraftContext) -> None:
        self.spec = ctx.backend.prepare(read(config.model, ctx.target))
        self.modules = {"speculator": self.spec}
        self.device = ctx.device

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        if not batch.requests:
            return []
        state = batch.runner_output.hidden[last_hidden_rows(batch)]          # [B, H]
        tokens = torch.tensor([r.all_token_ids[-1] for r in batch.requests], device=self.device)
        drafts = []
        for i in range(max(batch.max_num_tokens)):
            state, logits = self.spec.stage(i, state, tokens)
            tokens = logits.argmax(dim=-1)                                   # [B]
            drafts.append(tokens)
        drafts = torch.stack(drafts, dim=1).tolist()                         # [B, k]
        return [Proposal(d[:k]) for d, k in zip(drafts, batch.max_num_tokens)]


SPEC = MethodSpec(
    name="mlp_speculator", build=MLPSpeculatorProposer,
    summary="IBM MLP speculator on the target's last hidden state",
    detect=("mlp_speculator", "mlpspeculator"), needs_model=True, reads_hidden_states=True,
    default_k=lambda path: load_hf_config(path).get("n_predict"),   # one draft per stage
    new_head=new_head, read=read, write=write, loss=loss)
