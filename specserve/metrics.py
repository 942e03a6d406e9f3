"""Speculative-decoding counters (DESIGN.md §8) and what derives from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int                      # K: positions tracked per draft
    num_drafts: int = 0                       # verify steps with >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0
                for a in self.num_accepted_tokens_per_pos]

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
        }

    def log_line(self, elapsed_s: float) -> str:
        per_pos = ", ".join(f"{a:.3f}" for a in self.per_position_acceptance())
        return (f"SpecDecoding metrics: mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"acceptance rate {self.acceptance_rate:.1%}, accepted throughput "
                f"{self.num_accepted_tokens / max(elapsed_s, 1e-9):.1f} tokens/s, drafted "
                f"throughput {self.num_draft_tokens / max(elapsed_s, 1e-9):.1f} tokens/s, "
                f"drafts {self.num_drafts}, per-position acceptance [{per_pos}]")
