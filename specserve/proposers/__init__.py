"""Drafting methods behind one Proposer interface; `build_proposer` picks one by config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.config import SpeculativeConfig
from specserve.proposers.base import Proposal, ProposeBatch, Proposer

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

__all__ = ["Proposal", "ProposeBatch", "Proposer", "build_proposer"]


def build_proposer(config: SpeculativeConfig, engine: LLMEngine) -> Proposer:
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.proposers.eagle import HeadProposer
    from specserve.proposers.medusa import MedusaProposer
    from specserve.proposers.mlp_speculator import MLPSpeculatorProposer
    from specserve.proposers.ngram import NgramProposer
    from specserve.proposers.suffix import SuffixProposer

    builders = {"ngram": NgramProposer, "suffix": SuffixProposer,
                "draft_model": DraftModelProposer, "eagle": HeadProposer,
                "eagle3": HeadProposer, "mtp": HeadProposer, "medusa": MedusaProposer,
                "mlp_speculator": MLPSpeculatorProposer}
    if config.method not in builders:
        raise ValueError(f"speculative method {config.method!r} is not available in this "
                         f"build yet; available: {', '.join(builders)}")
    drafter = builders[config.method](config, engine)
    if config.hybrid_prompt_lookup is None:
        return drafter
    from specserve.proposers.hybrid import HybridProposer
    return HybridProposer(drafter, config.hybrid_prompt_lookup)
