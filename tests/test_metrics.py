"""SpecDecodingStats: counters, derived rates, per-position acceptance."""

from specserve.metrics import SpecDecodingStats


def test_counters_and_derived_rates():
    s = SpecDecodingStats(3)
    s.observe(3, 2)          # drafts d1 d2 accepted, d3 rejected
    s.observe(3, 3)
    s.observe(2, 0)          # a shorter draft (room left), all rejected
    s.observe(0, 0)          # no drafts: not a verify step with drafts
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 5)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1]
    assert s.acceptance_rate == 5 / 8
    assert s.mean_acceptance_length == 1 + 5 / 3
    assert s.per_position_acceptance() == [2 / 3, 2 / 3, 1 / 3]
    d = s.as_dict()
    assert d["spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 1]
    assert "mean acceptance length 2.67" in s.log_line(1.0)


def test_more_drafts_than_k_extend_the_positions_and_trees_count_nodes():
    s = SpecDecodingStats(2)
    s.observe(4, 4)
    assert s.num_accepted_tokens_per_pos == [1, 1, 1, 1]
    s.observe_tree_path([0, 2])
    s.observe_tree_path([0])
    assert s.num_accepted_tokens_per_node == [2, 0, 1]
    assert SpecDecodingStats(2).mean_acceptance_length == 1.0


def test_drafting_time_is_the_mean_over_drafting_steps():
    s = SpecDecodingStats(2)
    assert s.as_dict()["draft_ms_per_step"] == 0.0
    s.observe_drafting(0.004)
    s.observe_drafting(0.002)
    assert abs(s.as_dict()["draft_ms_per_step"] - 3.0) < 1e-9
