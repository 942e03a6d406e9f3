"""What every drafting method is: its record (`MethodSpec`), the context a proposer is built
from (`DraftContext`), what it sees each step (`ProposeBatch`) and gives back (`Proposal`), and
the `Proposer` protocol — everything the engine reads from a proposer is declared here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from specserve.kv_cache import KVCache
from specserve.models.backend import Backend
from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.config import SpeculativeConfig


@dataclass(slots=True)
class RunnerOutput:
    """What one target forward returns: sampled rows' logits and the hidden states drafters read."""

    logits: torch.Tensor            # [num_sample_rows, vocab] float32, request-major
    hidden: torch.Tensor            # [num_tokens, hidden] final hidden states of all fed tokens
    aux_hidden: torch.Tensor | None  # [num_tokens, len(aux_layers) * hidden] or None
    cu_num_tokens: list[int]        # [batch + 1] offsets of each request's tokens in the flat batch
    starts: list[int]               # [batch] position of each request's first fed token

    def rows(self, i: int, num_valid_end: int) -> tuple[int, int]:
        """Flat rows of request i whose KV is kept: positions starts[i]..num_valid_end-1."""
        return self.cu_num_tokens[i], self.cu_num_tokens[i] + num_valid_end - self.starts[i]


class DraftRequest(Protocol):
    """The part of a request a proposer reads (the engine's Request has it)."""

    request_id: str
    all_token_ids: list[int]            # prompt + output so far
    num_computed_tokens: int            # tokens whose KV the target holds
    slot: int | None                    # KV slot, shared by the proposer's own caches
    params: SamplingParams
    generator: torch.Generator          # the request's randomness (probabilistic drafting)

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...


@dataclass(frozen=True)
class DraftContext:
    """Everything a proposer may know of the engine it drafts for."""

    target: nn.Module               # the target model: heads share its embedding and lm_head
    target_path: str                # its directory (MTP layers live in its checkpoint)
    num_slots: int                  # KV slots (most requests running at once)
    max_model_len: int              # the target's context length
    vocab_size: int
    backend: Backend                # the drafter's: the target's, with speculative quantization
    # With draft_tensor_parallel_size > 1: loads a Llama-family draft model (directory, context
    # length) sharded over the target's ranks, ready to run; None: drafters run whole here.
    load_sharded: Callable[[str, int], nn.Module] | None = None
    # With draft_tensor_parallel_size > 1: a head (as read, float32) and its KV context length
    # -> the head with its decoder layers sharded over the target's ranks (the rest whole
    # here), prepared by the backend; None: heads are prepared whole here.
    shard_head: Callable[[nn.Module, int], nn.Module] | None = None

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backend.dtype

    @property
    def num_target_layers(self) -> int:
        """Target layers whose hidden states a proposer may ask for: 0..this - 1."""
        return self.target.args.num_hidden_layers

    def new_kv_cache(self, num_layers: int, num_kv_heads: int, max_len: int, head_dim: int,
                     dtype: torch.dtype | None = None) -> KVCache:
        """A KV cache with one slot per engine slot (allocated in lockstep with the target's)."""
        return KVCache(num_layers, self.num_slots, num_kv_heads, max_len, head_dim,
                       dtype or self.dtype, self.device, scratch_slot=self.backend.cuda_graphs)


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]                  # <= the request's budget; may be empty
    probs: torch.Tensor | None = None     # [len(token_ids), vocab] draft probabilities, or None
    # A draft tree: each token's parent (-1 = the last verified token), parents before children,
    # siblings with distinct tokens. None = a chain. Tree drafts are one-hot (no probs).
    parents: list[int] | None = None


@dataclass(slots=True)
class ProposeBatch:
    """Requests that decode next step, with how many drafts each may get, and the target step
    that just ran (all of its requests, including prompt chunks, for proposers that keep state
    built from the target's hidden states)."""

    requests: list[DraftRequest]
    max_num_tokens: list[int]             # per request: min(K, room left before its limits)
    step_requests: list[DraftRequest]     # every request of the step, in runner order
    runner_output: RunnerOutput


class Proposer(Protocol):
    """One drafting method at run time. The engine reads these members and nothing else."""

    # Target layers whose input hidden states the proposer needs (EAGLE-3); () for none.
    aux_hidden_layers: tuple[int, ...]
    # The proposer's own KV caches (slots allocated with the target's); [] for none.
    caches: list[KVCache]
    # The longest context it can draft for (a draft model's own limit); None = the target's.
    max_model_len: int | None
    # Its models by role ("draft model", "head"), for the engine's one-line backend log.
    modules: dict[str, nn.Module]
    # Prefix caching: whether its state of a prompt prefix may come from the cache (its
    # caches' first positions, see `prefix_positions`); False turns prefix caching off (a
    # proposer that needs the target's features of every position).
    reuses_prefix: bool

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        """Draft up to `batch.max_num_tokens[i]` tokens for each of `batch.requests` (which may
        be empty: the call still lets stateful proposers see the step)."""
        ...

    def finish(self, request: DraftRequest) -> None:
        """Forget per-request state (the request finished or was aborted)."""
        ...

    def prefix_positions(self, request: DraftRequest) -> int | None:
        """Positions of the request's slot in `caches` that now hold its state of the
        request's verified tokens (what the prefix cache may store); None: it keeps none."""
        ...

    def resume_prefix(self, request: DraftRequest, num_positions: int) -> None:
        """Before the request's first step: its slot in `caches` holds positions
        < num_positions (copied from the prefix cache); the target computes from there."""
        ...

    def reset(self) -> None:
        """Forget state kept across requests (a suffix tree of past responses)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters of its own (for benchmarks and logs); {} for none."""
        ...


class ProposerBase:
    """Defaults of the declared members for proposers that need none of them."""

    aux_hidden_layers: tuple[int, ...] = ()
    caches: list[KVCache] = []
    max_model_len: int | None = None
    modules: dict[str, nn.Module] = {}

    @property
    def reuses_prefix(self) -> bool:
        return not self.caches       # a proposer with caches says how they are resumed

    def finish(self, request: DraftRequest) -> None:
        pass

    def prefix_positions(self, request: DraftRequest) -> int | None:
        return None

    def resume_prefix(self, request: DraftRequest, num_positions: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


@dataclass(frozen=True)
class MethodSpec:
    """Everything the rest of specserve knows of one method; adding a method = a file with one
    of these + a line in methods/__init__.py."""

    name: str
    build: Callable[[SpeculativeConfig, DraftContext], Proposer]
    summary: str                              # one line for help texts
    aliases: tuple[str, ...] = ()
    # lower-case substrings of a checkpoint's model_type / architectures / directory name that
    # mean this method (checked in registry order, first match wins)
    detect: tuple[str, ...] = ()
    needs_model: bool = False                 # speculative_config 'model' is required
    reads_hidden_states: bool = False         # drafts from the target's hidden states (a head)
    drafts_trees: bool = False                # takes speculative_token_tree
    steps_drafts: bool = False                # drafts token by token: draft_confidence_threshold
    samples_drafts: bool = False              # draft_sample_method 'probabilistic' (with probs)
    drafts_in_parallel: bool = False          # parallel_drafting: K drafts in one drafter pass
    shards: bool = False                      # draft_tensor_parallel_size > 1 shards its drafter
    keys: tuple[str, ...] = ()                # speculative_config keys only this method takes
    # the K its checkpoint (a directory) gives when num_speculative_tokens is left out
    default_k: Callable[[str], int | None] | None = None
    # a larger K (a multiple of that) runs the checkpoint's heads or layers in turn
    repeats_layers: bool = False
    # drafts from its own output, so any K runs: default_k is only a default, not a limit
    recurrent: bool = False
    # fills in and checks this method's keys (in place)
    configure: Callable[[SpeculativeConfig], None] | None = None
    # Heads (methods with a trainable module on the target): a fresh head for training
    # (target, k, draft_vocab, token_counts) -> module; its public checkpoint format read
    # (path, target) -> module in float32 and written (head, out_dir, target_dir, dtype); its
    # training loss (head, x, pos, h, aux, logp, k, distill) -> (loss, logged values), see
    # train/heads.py for the arguments.
    new_head: Callable[..., nn.Module] | None = None
    read: Callable[[str | Path, nn.Module], nn.Module] | None = None
    write: Callable[..., None] | None = None
    loss: Callable[..., tuple[torch.Tensor, dict[str, float]]] | None = None
    # speculative_config 'model' defaults to the target itself (MTP layers live in it)
    model_is_target: bool = False
    # speculative_config keys the benchmarks and the zoo use with it
    suggested: dict = field(default_factory=dict)
    # `bench --methods available` runs it (the zoo has what it needs)
    in_benchmarks: bool = True
