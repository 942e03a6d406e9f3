"""Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim).

Weights are held fused (`qkv_proj`, `gate_up_proj`) for fewer kernel launches per step; the
loader maps Hugging Face tensor names onto them and `hf_state_dict` maps them back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specserve.models.layers import MLP, Attention, AttentionMetadata, RMSNorm, Rotary

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# MiMo is a Qwen2 model with MTP layers beside it (methods/mtp.py reads those)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MiMoForCausalLM")


@dataclass
class LlamaArgs:
    """The shape of a model, read from its config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None       # rope_type (linear, dynamic, llama3, yarn) and its
                                    # parameters; None for default rope
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None      # only accepted when max_model_len fits inside it

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> LlamaArgs:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ValueError(f"{source}: architecture {arch!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"{source}: required key {key!r} is missing")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        # transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor "
                             f"{rope['partial_rotary_factor']} is not supported (only 1.0)")
        if rope_type != "default":
            rope = rope | {"rope_type": rope_type}
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("max_position_embeddings", 2048))
            if rope_type in ("linear", "dynamic", "llama3") and "factor" not in rope:
                raise ValueError(f"{source}: rope type {rope_type!r} needs 'factor'")
            if rope_type == "yarn" and rope.get("factor") is None:
                rope["factor"] = (cfg.get("max_position_embeddings", 2048)
                                  / rope["original_max_position_embeddings"])
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        qwen3 = arch == "Qwen3ForCausalLM"
        window = cfg.get("sliding_window")
        if (arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM")
                and not cfg.get("use_sliding_window")):
            window = None
        default_bias = arch in ("Qwen2ForCausalLM", "MiMoForCausalLM")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", default_bias)),
            qk_norm=qwen3,
            sliding_window=window,
        )

    def to_hf_config(self) -> dict:
        """config.json contents for a model this project trains (Llama, or Qwen3: DFlash)."""
        model_type = {("LlamaForCausalLM", False): "llama",
                      ("Qwen3ForCausalLM", True): "qwen3"}[self.architecture, self.qk_norm]
        return {
            "architectures": [self.architecture], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "hidden_act": "silu", "mlp_bias": False,
        }


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream. `attn_in_dim`: the
    attention's input width where a subclass feeds it something other than the normed stream
    (EAGLE-3's 2H-wide pair)."""

    def __init__(self, a: LlamaArgs, attn_in_dim: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                                   a.head_dim, a.attention_bias, a.qk_norm, a.rms_norm_eps,
                                   in_dim=attn_in_dim)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        # Set when this layer holds one rank's shard (models/tensor_parallel.py): the
        # attention and MLP outputs are partial sums, which all_reduce(t) completes in place.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata | None, cache, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.step(x, cos_sin, md, cache, mask)

    def step(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
             md: AttentionMetadata | None, cache, mask: torch.Tensor | None = None,
             attn_in: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream x [..., H] through the layer; the attention reads `attn_in`
        when given, else input_layernorm(x). (The backend's variant runs it in compiled
        code.)"""
        a = self.input_layernorm(x) if attn_in is None else attn_in
        x = x + self._reduced(self.self_attn(a, cos_sin, md, cache, mask))
        return x + self._reduced(self.mlp(self.post_attention_layernorm(x)))

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce(partial)
        return partial


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` projects them."""

    def __init__(self, args: LlamaArgs, max_len: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(args.head_dim, max_len or args.max_position_embeddings,
                             args.rope_theta, args.rope_scaling)
        self.tp_size = 1                # ranks its layers are sharded over (tensor_parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata | None = None,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                aux_layers: tuple[int, ...] = (), mask: torch.Tensor | None = None):
        """input_ids, positions: [num_tokens] with `md` (cached inference) or [batch, seq]
        without (dense training: causal, or `mask` [seq, seq] bool, True = may attend).
        Returns the final (normed) hidden states [..., hidden_size]; with `aux_layers`, also
        the inputs of those layers concatenated [..., len(aux_layers) * hidden_size] (what
        EAGLE-3 heads read)."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.tables(positions, x.dtype)
        saved = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                saved[i] = x
            x = layer(x, cos_sin, md, None if kv_caches is None else kv_caches[i], mask)
        if aux_layers:
            return self.norm(x), torch.cat([saved[i] for i in aux_layers], dim=-1)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)                              # [..., vocab_size]

    def greedy_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits for rows that only an argmax reads: exact wherever a row's largest
        may be, -inf elsewhere where the lm_head can screen (the CPU kernel's)."""
        screen = getattr(self.lm_head, "greedy_logits", None)
        return self.compute_logits(hidden) if screen is None else screen(hidden)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
