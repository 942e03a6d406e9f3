"""Megatron-style tensor parallelism of a Llama-family model over a torch.distributed process
group: each rank keeps its share of the attention heads (q/k/v rows, o_proj columns) and of the
MLP's intermediate columns (gate/up rows, down_proj columns); the outputs of o_proj and
down_proj are partial sums, completed by one all-reduce each (`DecoderLayer.all_reduce`:
gloo's, or through shared memory where the ranks share a machine and the CPU kernel runs). The
embedding, norms and lm_head stay whole on every rank, so the residual stream and the final
hidden state are whole everywhere (what samplers and draft heads read)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specserve.models.llama import DecoderLayer, LlamaArgs, LlamaForCausalLM


def check_divisible(args: LlamaArgs, size: int, whose: str = "model's") -> None:
    """ValueError naming the first dimension `size` ranks cannot split evenly."""
    dims = {"attention heads": args.num_attention_heads, "KV heads": args.num_key_value_heads,
            "intermediate size": args.intermediate_size}
    for what, n in dims.items():
        if n % size:
            ok = [d for d in range(1, n + 1) if all(m % d == 0 for m in dims.values())]
            raise ValueError(f"tensor_parallel_size={size} does not divide the {whose} {n} "
                             f"{what}; use one of {ok}")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None,
            whole: torch.Tensor | None = None) -> nn.Linear:
    """A linear of `weight`; `whole`: the unsharded weight of a shard of its inputs, whose
    columns' largest magnitudes it keeps (`row_absmax`), so that quantization at load gives it
    the unsharded int8 values."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    if whole is not None:
        lin.row_absmax = whole.detach().abs().amax(1).float()                     # [out]
    return lin


def gloo_all_reduce(group) -> Callable[[torch.Tensor], None]:
    """In-place sum over a torch.distributed process group's ranks."""
    return lambda t: group.allreduce([t]).wait()


def shard_layer(layer: DecoderLayer, rank: int, size: int,
                all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Keep rank `rank` of `size`'s share of a decoder layer's heads and MLP columns (in place,
    before the backend packs the weights), its partial sums completed by `all_reduce` (in
    place, the same on every rank)."""
    at, mlp = layer.self_attn, layer.mlp
    D = at.head_dim
    h, g = at.num_heads // size, at.num_kv_heads // size
    q = torch.arange(rank * h * D, (rank + 1) * h * D)
    kv = torch.arange(rank * g * D, (rank + 1) * g * D)
    rows = torch.cat([q, at.q_size + kv, at.q_size + at.kv_size + kv])
    b = at.qkv_proj.bias
    at.qkv_proj = _linear(at.qkv_proj.weight.detach()[rows], None if b is None else b[rows])
    at.o_proj = _linear(at.o_proj.weight.detach()[:, q], None, at.o_proj.weight)
    at.num_heads, at.num_kv_heads, at.q_size, at.kv_size = h, g, h * D, g * D
    i = mlp.intermediate // size
    cols = torch.arange(rank * i, (rank + 1) * i)
    mlp.gate_up_proj = _linear(
        mlp.gate_up_proj.weight.detach()[torch.cat([cols, mlp.intermediate + cols])], None)
    mlp.down_proj = _linear(mlp.down_proj.weight.detach()[:, cols], None, mlp.down_proj.weight)
    mlp.intermediate = i
    layer.all_reduce = all_reduce


def shard(model: LlamaForCausalLM, rank: int, size: int,
          all_reduce: Callable[[torch.Tensor], None]) -> LlamaForCausalLM:
    """Keep rank `rank` of `size`'s share of every layer (`shard_layer`)."""
    check_divisible(model.args, size)
    for layer in model.layers:
        shard_layer(layer, rank, size, all_reduce)
    model.tp_size = size
    return model
