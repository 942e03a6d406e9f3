"""Which configurations the benchmarks compare (the runs themselves are not tests)."""

from __future__ import annotations

import argparse

import pytest

from specserve import SamplingParams, TokensPrompt
from specserve.bench.methods import add_common_args, configs
from tests.conftest import DEVICE


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_args(p)
    return p.parse_args(list(argv))


def test_available_methods_are_those_with_files(tmp_path):
    target, draft = tmp_path / "t", tmp_path / "d"
    for d in (target, draft, tmp_path / "t-eagle3", tmp_path / "t-mtp"):
        d.mkdir()
        (d / "config.json").write_text("{}")
    got = configs(_args("--target", str(target), "--draft", str(draft), "--spec-extra",
                        '{"disable_by_batch_size": 8}'))
    assert list(got) == ["ngram", "suffix", "draft_model", "eagle3", "mtp"]
    assert got["eagle3"] == (str(target), {"method": "eagle3", "num_speculative_tokens": 4,
                                           "model": str(tmp_path / "t-eagle3"),
                                           "disable_by_batch_size": 8})
    assert got["mtp"][0] == str(tmp_path / "t-mtp")          # the MTP dir is the model loaded


def test_named_methods_are_kept_and_unknown_ones_named():
    assert list(configs(_args("--methods", "medusa,ngram"))) == ["medusa", "ngram"]
    with pytest.raises(SystemExit, match="unknown method 'foo'"):
        configs(_args("--methods", "foo"))


def test_method_at_dir_compares_two_heads():
    got = configs(_args("--methods", "eagle3,eagle3@old/e3,mtp@old/mtp,draft_model@d2"))
    assert list(got) == ["eagle3", "eagle3@old/e3", "mtp@old/mtp", "draft_model@d2"]
    assert got["eagle3"][1]["model"] == "models/code-target-eagle3"
    assert got["eagle3@old/e3"][1]["model"] == "old/e3"
    assert got["mtp@old/mtp"][0] == "old/mtp"
    assert got["draft_model@d2"][1]["model"] == "d2"
    with pytest.raises(SystemExit, match="ngram drafts without a model"):
        configs(_args("--methods", "ngram@x"))


def test_a_catalogue_targets_drafters_keep_their_method_names():
    """The zoo's heads sit beside their target directory with hyphens; the drafters bundled
    for a catalogue name carry the method's own name (smollm2-135m-instruct-mlp_speculator)."""
    got = configs(_args("--target", "smollm2-135m-instruct", "--methods", "mlp_speculator"))
    assert got["mlp_speculator"][1]["model"] == "smollm2-135m-instruct-mlp_speculator"
    zoo = configs(_args("--methods", "mlp_speculator"))
    assert zoo["mlp_speculator"][1]["model"] == "models/code-target-mlp-speculator"


def test_method_plus_tree_drafts_the_token_tree():
    tree = "[(0,), (1,), (0, 0)]"
    got = configs(_args("--methods", "eagle3,eagle3+tree,mtp+tree@old/mtp", "--token-tree", tree))
    assert got["eagle3"][1]["num_speculative_tokens"] == 4
    assert got["eagle3+tree"][1] == {"method": "eagle3", "model": "models/code-target-eagle3",
                                     "speculative_token_tree": tree}
    assert got["mtp+tree@old/mtp"][0] == "old/mtp"
    assert configs(_args("--methods", "eagle3+int8"))["eagle3+int8"][1]["quantization"] == "int8"
    assert configs(_args("--methods", "ngram+adaptive"))["ngram+adaptive"][1]["adaptive_k"]
    with pytest.raises(SystemExit, match="needs --token-tree"):
        configs(_args("--methods", "eagle3+tree"))
    for bad in ("eagle3+wide", "eagle3+k=x", "eagle3+conf", "eagle3+lookup=x"):
        with pytest.raises(SystemExit, match="unknown suffix"):
            configs(_args("--methods", bad, "--token-tree", tree))


def test_a_chat_set_is_rendered_through_the_targets_chat_template(smollm2):
    from specserve.bench.methods import prompt_set
    from specserve.data.prompts import PROMPT_SETS
    raw, rendered = PROMPT_SETS["chat"](2), prompt_set("chat", 2, "smollm2-135m-instruct")
    assert [r.count(p) for p, r in zip(raw, rendered)] == [1, 1]
    assert all(r.startswith("<|im_start|>") and r.endswith("<|im_start|>assistant\n")
               for r in rendered)
    assert prompt_set("completion", 2, "smollm2-135m-instruct") == PROMPT_SETS["completion"](2)


def test_bench_tree_writes_the_best_trees_of_each_size(tmp_path):
    import json

    from specserve.bench import tree
    tree.main(["tree", "--max-depth", "2", "--max-rank-sum", "1", "--sizes", "1,3",
               "--prompt-sets", "completion", "--num-prompts", "1", "--max-tokens", "8",
               "--device", DEVICE, "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert len(data["node_rates"]) == len(data["node_paths"]) == 5
    assert [r["nodes"] for r in data["rows"]][0] == 1 and list(tmp_path.glob("*.png"))


def test_auto_is_benchmarked_as_a_user_gets_it_unless_k_is_given():
    got = configs(_args("--methods", "auto,auto+k=4", "--num-speculative-tokens", "3"))
    assert got["auto"][1] == {"method": "auto"}
    assert got["auto+k=4"][1] == {"method": "auto", "num_speculative_tokens": 4}


def test_auto_is_labelled_with_the_k_and_threshold_it_settles_for_its_target(smollm2):
    from specserve.bench.latency import _k_label
    from specserve.methods import AUTO_CONFIDENCE, AUTO_K
    # the toy target has no drafter of its own: lookup, AUTO_K; a target with an MTP layer
    # drafts with it, at the one token the layer predicts, stopping where it is unsure
    assert _k_label({"method": "auto"}, "models/code-target") == f"K<={AUTO_K}"
    assert (_k_label({"method": "auto"}, "models/code-target-mtp")
            == f"K<=1, conf >= {AUTO_CONFIDENCE:g}")
    assert _k_label({"method": "auto", "num_speculative_tokens": 2},
                    "models/code-target") == "K<=2"
    # a catalogue name, as bench takes it: its bundled EAGLE-3 head
    assert (_k_label({"method": "auto"}, "smollm2-135m-instruct")
            == f"K<={AUTO_K}, conf >= {AUTO_CONFIDENCE:g}")


def test_method_plus_k_conf_and_lookup_set_k_the_threshold_and_lookup():
    got = configs(_args("--methods", "eagle3,eagle3+k=8+conf=0.2,draft_model+conf=0.3,"
                        "eagle3+lookup=3"))
    assert got["eagle3+lookup=3"][1]["hybrid_prompt_lookup"] == 3
    assert got["eagle3+k=8+conf=0.2"][1] == {
        "method": "eagle3", "model": "models/code-target-eagle3", "num_speculative_tokens": 8,
        "draft_confidence_threshold": 0.2}
    assert got["draft_model+conf=0.3"][1]["num_speculative_tokens"] == 4
    assert got["draft_model+conf=0.3"][1]["draft_confidence_threshold"] == 0.3


def test_weight_bytes_as_stored_and_as_the_cpu_kernel_streams_them(llama_dir):
    import torch

    from specserve.bench.probes import weight_bytes
    from specserve.kernels.cpu import load_library
    from specserve.models.cpu_backend import use_decode_linears
    from specserve.models.loader import load_model
    model = load_model(llama_dir, torch.float32, torch.device("cpu"))
    a = model.args
    embed = a.vocab_size * a.hidden_size * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert weight_bytes(model) == total - (0 if a.tie_word_embeddings else embed)
    with torch.no_grad():                   # bfloat16-valued weights, like the bundled zoo
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    as_stored = weight_bytes(model)
    use_decode_linears(model)
    assert weight_bytes(model) == as_stored            # a packed weight counts as float32
    packed = [m for m in model.modules() if getattr(m, "kernel_weight", None) is not None]
    assert bool(packed) == (load_library() is not None)
    for m in packed:            # bfloat16: half of float32's bytes, plus padding columns
        half = m.in_features * m.out_features * 2
        assert half <= m.kernel_weight.nbytes < half + 64 * (m.in_features + 1) * 2
    linear = sum(m.in_features * m.out_features * 4 for m in packed)
    streamed = as_stored - linear + sum(m.kernel_weight.nbytes for m in packed)
    assert weight_bytes(model, streamed=True) == streamed


class _Runner:
    """A runner that writes `token` max_tokens times and checks that no round sees an earlier
    round's prompts."""

    def __init__(self, name: str, dtype: str = "float32", token: int = 1,
                 tpot: float | None = None) -> None:
        self.name, self.dtype, self.token, self.rounds, self.seen = name, dtype, token, 0, set()
        self.tpot = tpot
        self.seeds: dict[str, int] = {}

    def tpot_ms(self):
        return self.tpot

    def new_round(self):
        self.rounds += 1
        self.seen.clear()

    def run(self, prompts, max_tokens, temperature=0.0, first_seed=0):
        assert not self.seen & set(prompts), "a round saw an earlier round's answers"
        self.seen |= set(prompts)
        self.seeds |= {p: first_seed + i for i, p in enumerate(prompts)}
        return [[self.token] * max_tokens for _ in prompts]

    def acceptance(self):
        return None

    def note(self):
        return None


def test_each_round_starts_without_the_previous_rounds_answers():
    """The rounds repeat the same prompts: a runner forgets what it learned from them (suffix's
    past responses) before each round, so that the rounds measure the same thing."""
    from specserve.bench.latency import run_suite
    runners = [_Runner("a"), _Runner("b")]
    run_suite(runners, ["p", "q", "r"], batch=2, max_tokens=3, rounds=3)
    assert [r.rounds for r in runners] == [3, 3]


def test_the_runners_take_turns_on_every_prompt_group():
    """Each prompt group is run by every runner before the next group starts, their order
    reversed from group to group: a drift of the machine's speed within a round falls on all
    configurations alike, not on whichever ran last."""
    from specserve.bench.latency import run_suite
    log: list[tuple[str, str]] = []
    runners = [_Runner("a"), _Runner("b"), _Runner("c")]
    for r in runners:
        run = r.run
        r.run = lambda ps, *a, _n=r.name, _run=run: log.append((_n, ps[0])) or _run(ps, *a)
    run_suite(runners, ["p", "q", "r"], batch=1, max_tokens=3, rounds=2)
    timed = log[3:]                                             # after the warm-up runs
    assert timed == [(n, p) for rnd in range(2) for j, p in enumerate("pqr")
                     for n in ("abc" if (rnd + j) % 2 == 0 else "cba")]


def test_every_prompt_has_its_own_seed_whatever_the_batch_size():
    """Seeds follow a prompt's place in the suite, not in its batch: at batch 1 every request
    seeded 0 drew the same synthetic acceptances, a sample of one."""
    from specserve.bench.latency import run_suite
    for batch in (1, 2):
        runner = _Runner("a")
        run_suite([runner], ["p", "q", "r"], batch=batch, max_tokens=3, rounds=1)
        assert runner.seeds == {"p": 0, "q": 1, "r": 2}


def test_greedy_outputs_are_compared_with_the_no_spec_of_their_dtype():
    from specserve.bench.latency import run_suite
    runners = [_Runner("a"), _Runner("b"), _Runner("c", "bfloat16", 2),
               _Runner("d", "bfloat16", 1)]
    results = {r.name: r for r in run_suite(runners, ["p", "q", "r"], batch=2, max_tokens=3,
                                             rounds=1)}
    assert [results[n].same_output for n in "abcd"] == ["3/3", "3/3", "3/3", "0/3"]


def _suite():
    from specserve.bench.latency import run_suite
    runners = [_Runner("specserve no-spec", tpot=3.0), _Runner("specserve fast", tpot=1.5),
               _Runner("peer")]
    return [r.as_dict() for r in run_suite(runners, ["p", "q"], batch=1, max_tokens=3,
                                           rounds=2)]


def test_table_shows_decode_speedup_from_tpot():
    """TPOT (decode alone) beside tokens/s: its speedup is against no-spec's TPOT; runners
    without per-token times (transformers) leave both cells empty."""
    from specserve.bench.report import latency_table
    rows = {line.split(" | ")[0][2:]: line.split(" | ")
            for line in latency_table(_suite()).splitlines()[2:]}
    assert rows["specserve no-spec"][3:5] == ["3.00", "1.00x"]
    assert rows["specserve fast"][3:5] == ["1.50", "2.00x"]
    assert rows["peer"][3:5] == ["", ""]


def test_the_tokens_per_s_cell_shows_the_rounds_range():
    """Beside the median, the slowest and fastest round: how much the machine moved."""
    from specserve.bench.report import latency_table
    suite = _suite()
    suite[1]["tokens_per_s"], suite[1]["median_tokens_per_s"] = [90.0, 120.0, 100.0], 100.0
    suite[0]["tokens_per_s"] = [50.0]
    rows = {line.split(" | ")[0][2:]: line.split(" | ")
            for line in latency_table(suite).splitlines()[2:]}
    assert rows["specserve fast"][1] == "100.0 (90-120)"
    assert rows["specserve no-spec"][1] == f"{suite[0]['median_tokens_per_s']:.1f}"


def test_efficiency_is_the_decode_speedup_over_tau():
    """tau is what free drafting with verify steps as cheap as decode steps would give."""
    from specserve.bench.report import latency_table
    suite = _suite()
    suite[1]["tau"] = 4.0
    rows = {line.split(" | ")[0][2:]: line.split(" | ")
            for line in latency_table(suite).splitlines()[2:]}
    assert rows["specserve fast"][4:7] == ["2.00x", "4.00", "50%"]
    assert rows["specserve no-spec"][6] == ""


def _latency_run() -> dict:
    from specserve.bench.probes import machine
    suite = _suite()
    for r, speed in zip(suite, (100.0, 200.0, 50.0)):     # timings of fake runners are noise
        r["median_tokens_per_s"] = speed
    return {"benchmark": "latency", "title": "t", "command": "specserve bench latency x",
            # whatever this CPU is, the run is named as the AVX-512 CPU's
            "machine": machine() | {"isa": "avx512"},
            "settings": {"target": "models/code-target", "draft": "D", "dtypes": ["float32"],
                         "temperature": 0.0, "num_prompts": 2,
                         "max_tokens": 3, "rounds": 2, "speculative_config_extra": None,
                         "configs": {}},
            "bandwidth_gbs": 10.0, "weight_bytes": 10**7, "weight_bytes_streamed": 5 * 10**6,
            "decode_ms_per_token": {"specserve no-spec": 1.0},
            "prompt_ms": {"lengths": [64], "by_config": {"specserve no-spec": [5.0]}},
            "suites": {f"{p}, batch {b}": suite for p in ("completion", "editing")
                       for b in (1, 8)}}


def test_a_run_writes_its_json_table_and_plot_to_runs_and_publishes_on_request(tmp_path,
                                                                                monkeypatch):
    import json

    from specserve.bench import report
    monkeypatch.setattr(report, "LATEST", tmp_path / "latest")
    monkeypatch.setattr(report, "HISTORY", tmp_path / "HISTORY.md")
    data = _latency_run()
    paths = report.save(data, tmp_path / "runs")
    assert json.loads(open(paths["json"]).read()) == data
    assert "### completion, batch 1" in open(paths["table"]).read()
    assert open(paths["plot"], "rb").read(4) == b"\x89PNG"
    assert not (tmp_path / "latest").exists() and not (tmp_path / "HISTORY.md").exists()
    report.save(data, tmp_path / "runs", publish=True)
    assert sorted(p.name for p in (tmp_path / "latest").iterdir()) == [
        "latency.json", "latency.md", "latency.png"]
    (line,) = (tmp_path / "HISTORY.md").read_text().splitlines()
    assert "`specserve bench latency x`" in line and "completion, batch 1: fast 2.00x" in line
    table = report.readme_table(data)
    assert "| fast | 2.00x | 2.00x | 2.00x / 2.00x | 2.00x | 2.00x |" in table
    # one row per method, at its fastest K (the other Ks stay in latency.md)
    for rows in data["suites"].values():
        rows += [dict(rows[1], name="specserve fast+k=8 (K=8)", median_tokens_per_s=150.0),
                 dict(rows[1], name="specserve slow+k=2 (K=2)", median_tokens_per_s=90.0),
                 dict(rows[1], name="specserve slow (K=4)", median_tokens_per_s=80.0)]
    methods = [line.split(" | ")[0] for line in report.readme_table(data).splitlines()[4:]]
    assert methods == ["| fast", "| slow+k=2 (K=2)"]


def test_gpu_and_built_target_runs_publish_beside_the_cpu_run(tmp_path, monkeypatch):
    from specserve.bench import report
    monkeypatch.setattr(report, "LATEST", tmp_path / "latest")
    monkeypatch.setattr(report, "HISTORY", tmp_path / "HISTORY.md")
    data = _latency_run()
    zoo = "models/code-target"
    for device, target in (("cpu", zoo), ("cuda:0", zoo), ("cpu", "random:llama-3.2-1b"),
                           ("cpu", "random:hidden=64,layers=2,inter=128,heads=4,kv=2"),
                           ("cpu", "padded:models/code-target,inter=32768"),
                           ("cpu", "smollm2-135m-instruct")):
        data["settings"] |= {"device": device, "target": target}
        report.publish_run(data)
    data["machine"]["isa"] = "avx2"                 # a CPU without AVX-512: beside it too
    data["settings"] |= {"device": "cpu", "target": zoo}
    report.publish_run(data)
    assert sorted(p.stem for p in (tmp_path / "latest").glob("*.json")) == [
        "latency", "latency-avx2", "latency-cuda",
        "latency-hidden-64-layers-2-inter-128-heads-4-kv-2", "latency-llama-3-2-1b",
        "latency-padded-code-target-inter-32768", "latency-smollm2-135m-instruct"]
    assert len((tmp_path / "HISTORY.md").read_text().splitlines()) == 7


def test_specserve_runner_times_each_request_after_its_first_token(llama_dir):
    from specserve.bench.runners import SpecserveRunner
    r = SpecserveRunner("plain", str(llama_dir), None, "float32")
    r.new_round()
    r.run([TokensPrompt(prompt_token_ids=[1, 2, 3]), TokensPrompt(prompt_token_ids=[4, 5])],
          max_tokens=6)
    r.run([TokensPrompt(prompt_token_ids=[6])], max_tokens=1)   # one token: no time per token
    assert len(r.tpots) == 2 and all(t > 0 for t in r.tpots)
    assert r.tpot_ms() == sum(r.tpots) / 2          # the median of two
    r.new_round()
    assert r.tpot_ms() is None


def test_hybrid_runner_notes_the_share_of_lookup_drafts(llama_dir, draft_dir):
    from specserve.bench.runners import SpecserveRunner
    from tests.test_spec_decode import repetitive_prompts
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    plain = SpecserveRunner("plain", str(llama_dir), spec, "float32")
    hybrid = SpecserveRunner("hybrid", str(llama_dir), spec | {"hybrid_prompt_lookup": 2},
                             "float32")
    for r in (plain, hybrid):
        r.llm.generate([TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(4)],
                       SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert plain.note() is None
    lookups = hybrid.llm.engine.proposer.num_lookup_drafts
    share = lookups / hybrid.llm.get_stats()["spec_decode_num_drafts"]
    assert 0 < share < 1 and hybrid.note() == f"lookup drafted {share:.0%}"


def test_prompt_ms_times_a_prompt_of_the_given_length(llama_dir):
    from specserve import LLM
    from specserve.bench.probes import prompt_ms
    llm = LLM(str(llama_dir), device=DEVICE)
    fed = []
    model_forward = llm.engine.model.forward
    llm.engine.model.forward = lambda ids, *a, **k: fed.append(len(ids)) or model_forward(
        ids, *a, **k)
    assert prompt_ms(llm, 40, repeats=2) > 0
    assert fed == [40, 40, 40]            # a warm-up and two timed runs, one prompt step each


def test_decode_against_read_pairs_each_decode_timing_with_the_reads_around_it(llama_dir,
                                                                               monkeypatch):
    from specserve import LLM
    from specserve.bench import probes
    from specserve.kernels.cpu import load_library
    llm = LLM(str(llama_dir), device="cpu")
    decodes, reads = iter([4.0, 9.0, 6.0]), iter([2.0, 2.0, 4.0, 2.0])
    monkeypatch.setattr(probes, "_decode_ms", lambda llm, tokens: next(decodes))
    real_read = probes.weights_read_ms
    monkeypatch.setattr(probes, "weights_read_ms", lambda model: next(reads))
    got = probes.decode_against_read(llm, repeats=3)
    # each decode over the mean of the reads before and after it: 4/2, 9/3, 6/3
    assert got == {"decode_ms": 6.0, "read_ms": 2.0, "over_read": 2.0}
    monkeypatch.setattr(probes, "weights_read_ms", real_read)
    if load_library() is not None:          # the kernel's weights: a read takes time
        assert real_read(llm.engine.model, repeats=2) > 0
    assert real_read(LLM(str(llama_dir), device="cpu", cpu_kernel=False).engine.model) is None


def test_draft_model_plus_parallel_drafts_with_the_zoos_pard_draft(tmp_path):
    got = configs(_args("--methods", "draft_model,draft_model+parallel+k=8,"
                        "draft_model+parallel@other"))
    assert got["draft_model+parallel+k=8"][1] == {
        "method": "draft_model", "num_speculative_tokens": 8, "parallel_drafting": True,
        "model": "models/code-draft-pard"}
    assert got["draft_model+parallel@other"][1]["model"] == "other"
    target, draft = tmp_path / "t", tmp_path / "d"
    for d in (target, draft, tmp_path / "d-pard"):
        d.mkdir()
        (d / "config.json").write_text("{}")
    avail = configs(_args("--target", str(target), "--draft", str(draft)))
    assert avail["draft_model+parallel"][1]["model"] == str(tmp_path / "d-pard")


def test_a_run_names_its_draft_only_where_a_configuration_loads_it(tmp_path):
    from specserve.bench import report
    from specserve.bench.latency import draft_used
    target, draft = tmp_path / "t", tmp_path / "d"
    for d in (target, draft, tmp_path / "d-pard", tmp_path / "h"):
        d.mkdir()
    own = configs(_args("--target", str(target), "--draft", str(draft),
                        "--methods", f"ngram,eagle3@{tmp_path / 'h'}"))
    assert not draft_used(str(draft), own, transformers=False)
    assert draft_used(str(draft), own, transformers=True)          # assisted generation
    for m in ("draft_model", "draft_model+parallel"):
        assert draft_used(str(draft), configs(_args("--target", str(target), "--draft",
                                                    str(draft), "--methods", m)), False)
    data = _latency_run()
    assert "draft D," in report.markdown(data)
    data["settings"]["draft"] = None
    (line,) = [ln for ln in report.markdown(data).splitlines() if ln.startswith("- target")]
    assert line.startswith("- target models/code-target, dtypes float32,")
