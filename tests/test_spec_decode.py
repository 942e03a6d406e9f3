"""Speculative decoding end to end: greedy equality for every method, acceptance with
draft == target, the sampled distribution, seeds, stop conditions and context limits."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt
from tests.conftest import DEVICE, make_hf_model

K = 3


def spec_configs(draft_dir):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": K},
        "draft_model": {"method": "draft_model", "model": str(draft_dir),
                        "num_speculative_tokens": K},
        "hybrid": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K,
                   "hybrid_prompt_lookup": 2},
    }


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats, so that ngram/suffix find matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(0, 90, (int(torch.randint(2, 12, (1,), generator=g)),),
                             generator=g).tolist()
        out.append((base * 4)[:int(torch.randint(3, 40, (1,), generator=g))])
    return out


def _greedy(max_tokens=30, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _seeded(i: int, **kw) -> SamplingParams:
    """A seeded sampled request: its tokens do not depend on speculation."""
    return SamplingParams(**{"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i,
                             "max_tokens": 30, "ignore_eos": True} | kw)


def assert_lossless_alone_and_mixed(target, spec: dict, num_prompts: int = 8,
                                    max_model_len: int = 96) -> dict:
    """Greedy output with `spec` equals the target's alone and in a mixed batch (prompts
    chunked 24 tokens a step, continuous batching over 4 slots), seeded samples among them
    equal too, and drafts were made; returns the stats."""
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(num_prompts, seed=3)]
    params = [_greedy(40) if i % 2 == 0 else _seeded(i, max_tokens=40) for i in range(len(ps))]
    base = LLM(str(target), device=DEVICE, max_model_len=max_model_len, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in base.generate(ps, params, use_tqdm=False)]
    llm = LLM(str(target), device=DEVICE, max_model_len=max_model_len, max_num_seqs=4,
              max_num_batched_tokens=24, speculative_config=spec)
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(ps[:2], params)]
    mixed = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert alone == ref[:2] and mixed == ref
    m = llm.get_stats()
    assert m["spec_decode_num_draft_tokens"] > m["spec_decode_num_drafts"] > 0
    return m


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "hybrid"])
def test_greedy_equality_batch_1(method, llama_dir, draft_dir):
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(4, seed=1)]
    base = LLM(str(llama_dir), device=DEVICE)
    ref = [base.generate(p, _greedy(), use_tqdm=False)[0].outputs[0].token_ids for p in ps]
    spec = LLM(str(llama_dir), speculative_config=spec_configs(draft_dir)[method], device=DEVICE)
    got = [spec.generate(p, _greedy(), use_tqdm=False)[0].outputs[0].token_ids for p in ps]
    assert got == ref
    assert spec.get_stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "hybrid"])
def test_greedy_equality_mixed_batch(method, llama_dir, draft_dir):
    """>= 16 mixed requests: different lengths, early stops (stop token / EOS), long ones near
    max_model_len, and random requests sharing the batch."""
    ps = repetitive_prompts(18, seed=2)
    base = LLM(str(llama_dir), device=DEVICE, max_model_len=64, max_num_seqs=8)
    free = [o.outputs[0].token_ids for o in base.generate(
        [TokensPrompt(prompt_token_ids=p) for p in ps], _greedy(40), use_tqdm=False)]
    params = []
    for i, toks in enumerate(free):
        if i % 5 == 1:      # stop on a token that appears mid-output
            params.append(_greedy(40, stop_token_ids=[toks[7]]))
        elif i % 5 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=40, seed=i))  # EOS may stop
        elif i % 5 == 3:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=10))
        else:
            params.append(_greedy(40))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ps]
    prompts[4] = TokensPrompt(prompt_token_ids=(ps[4] * 20)[:60])    # near max_model_len
    ref = base.generate(prompts, params, use_tqdm=False)
    spec = LLM(str(llama_dir), speculative_config=spec_configs(draft_dir)[method], device=DEVICE,
               max_model_len=64, max_num_seqs=8)
    got = spec.generate(prompts, params, use_tqdm=False)
    for i, (r, g) in enumerate(zip(ref, got)):
        if params[i].temperature > 0:
            continue           # random rows only share the batch here; see the distribution test
        assert g.outputs[0].token_ids == r.outputs[0].token_ids, f"request {i}"
        assert g.outputs[0].finish_reason == r.outputs[0].finish_reason
    assert len(got[4].outputs[0].token_ids) == 4 and got[4].outputs[0].finish_reason == "length"
    assert got[1].outputs[0].finish_reason == "stop"
    m = spec.get_stats()          # the speculative run did verify drafts, and accepted some
    assert m["spec_decode_num_drafts"] > 10 and m["spec_decode_num_accepted_tokens"] > 0


def test_draft_equal_to_target_accepts_everything(llama_dir):
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K}
    llm = LLM(str(llama_dir), speculative_config=spec, device=DEVICE)
    steps = 6
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(3)],
                        _greedy(1 + steps * (K + 1)), use_tqdm=False)
    m = llm.get_stats()
    assert m["acceptance_rate"] == 1.0
    assert m["mean_acceptance_length"] == K + 1
    assert m["spec_decode_num_accepted_tokens_per_pos"] == [3 * steps] * K
    for o in outs:
        assert o.spec_metrics.mean_acceptance_length == K + 1
        assert len(o.outputs[0].token_ids) == 1 + steps * (K + 1)


def test_spec_metrics_are_consistent(llama_dir, draft_dir):
    llm = LLM(str(llama_dir), speculative_config=spec_configs(draft_dir)["ngram"], device=DEVICE)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(5)],
                        _greedy(), use_tqdm=False)
    m = llm.get_stats()
    assert m["spec_decode_num_drafts"] == sum(o.spec_metrics.num_drafts for o in outs)
    assert m["spec_decode_num_accepted_tokens"] == sum(m["spec_decode_num_accepted_tokens_per_pos"])
    assert m["mean_acceptance_length"] == pytest.approx(
        1 + m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_drafts"])
    per_pos = m["spec_decode_num_accepted_tokens_per_pos"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert m["draft_ms_per_step"] > 0                  # the proposer was timed


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """Target and a different draft over 8 tokens: rejections happen often."""
    t, d = tmp_path_factory.mktemp("t8"), tmp_path_factory.mktemp("d8")
    make_hf_model("llama", t, seed=3, vocab=8, eos_token_id=7)
    make_hf_model("llama", d, seed=4, vocab=8, eos_token_id=7, hidden_size=32,
                  num_hidden_layers=1, intermediate_size=64)
    return t, d


PROMPT8 = [1, 2, 3, 1, 2]
TOP_K = 3


def _params(i: int, max_tokens: int = 3, seeded: bool = False) -> SamplingParams:
    """Unseeded: the rejection sampler; seeded: coupled verification (rejection.py)."""
    return SamplingParams(temperature=1.0, top_k=TOP_K, seed=i if seeded else None,
                          max_tokens=max_tokens, ignore_eos=True)


def _exact_pair_distribution(target, prompt: list[int] = PROMPT8) -> torch.Tensor:
    """P(token 2, token 3) of the target under _params, by enumerating token 1 and 2."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def probs(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        kth = logits.topk(TOP_K).values[-1]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    exact = torch.zeros(8, 8)
    p1 = probs(prompt)
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = probs(prompt + [a])
        for b in torch.nonzero(p2).flatten().tolist():
            exact[b] += p1[a] * p2[b] * probs(prompt + [a, b])
    return exact


def _token_hist(llm, n: int, offset: int, max_tokens: int = 3,
                prompt: list[int] = PROMPT8, seeded: bool = False) -> torch.Tensor:
    """Empirical joint distribution of generated tokens 2 and 3 (both from verify steps)."""
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n,
                        [_params(i + offset, max_tokens, seeded) for i in range(n)],
                        use_tqdm=False)
    hist = torch.zeros(8, 8)
    for o in outs:
        a, b = o.outputs[0].token_ids[1:3]
        hist[a, b] += 1
    return hist / n


N_SAMPLES = 2000
# 9 reachable cells: sampling noise in total variation is ~0.025 at 2000 samples.
TV_BOUND = 0.06


@pytest.fixture(scope="module")
def exact_pairs(small_vocab_pair):
    return _exact_pair_distribution(small_vocab_pair[0])


def test_no_spec_sampling_matches_exact_distribution(small_vocab_pair, exact_pairs):
    llm = LLM(str(small_vocab_pair[0]), device=DEVICE, max_num_seqs=64, max_num_batched_tokens=512)
    tv = 0.5 * (_token_hist(llm, N_SAMPLES, 0) - exact_pairs).abs().sum().item()
    assert tv < TV_BOUND, f"total variation {tv:.3f}"


@pytest.mark.parametrize("rejection, draft_sample, extra, seeded", [
    ("strict", "greedy", {}, False), ("strict", "probabilistic", {}, False),
    ("probabilistic", "probabilistic", {}, False),
    # the prompt holds 2 of the 3 first tokens the target can pick: those requests draft by
    # prompt lookup (one-hot drafts), the others by the draft model (sampled, with their probs)
    ("probabilistic", "probabilistic", {"hybrid_prompt_lookup": 1}, False),
    ("probabilistic", "probabilistic", {}, True)])
def test_spec_sampling_matches_exact_distribution(small_vocab_pair, exact_pairs, rejection,
                                                  draft_sample, extra, seeded):
    target, draft = small_vocab_pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
            "rejection_sample_method": rejection, "draft_sample_method": draft_sample} | extra
    llm = LLM(str(target), speculative_config=spec, device=DEVICE, max_num_seqs=64,
              max_num_batched_tokens=512)
    prompt = [4, 5, 6, 1, 2] if extra else PROMPT8
    exact = _exact_pair_distribution(target, prompt) if extra else exact_pairs
    hist = _token_hist(llm, N_SAMPLES, 100_000, prompt=prompt, seeded=seeded)
    tv = 0.5 * (hist - exact).abs().sum().item()
    assert llm.get_stats()["acceptance_rate"] < 0.95       # rejections were exercised
    if extra:
        assert 0.2 < llm.engine.proposer.num_lookup_drafts / N_SAMPLES < 0.8
    assert tv < TV_BOUND, f"total variation {tv:.3f} from the target's exact distribution"


TREE = "[(0,), (1,), (0, 0), (1, 0)]"


@pytest.mark.parametrize("shape, seed, seeded", [
    ({"num_speculative_tokens": 2}, 11, False),
    # a head whose second-best first token often lies in the target's top 3
    ({"speculative_token_tree": TREE}, 19, False),
    ({"speculative_token_tree": TREE}, 19, True)], ids=["chain", "tree", "tree-seeded"])
def test_eagle3_sampling_matches_exact_distribution(small_vocab_pair, exact_pairs, tmp_path,
                                                    shape, seed, seeded, monkeypatch):
    """A head over a reduced draft vocabulary (5 of the 8 ids reachable through d2t), whose
    greedy drafts the strict verifier treats as one-hot; as a chain, and as a tree whose
    second-best branch must also keep the distribution."""
    from tests.methods.test_heads import eagle3_ckpt
    head = eagle3_ckpt(tmp_path / "e3", draft_vocab=5, vocab=8, seed=seed)
    llm = LLM(str(small_vocab_pair[0]), device=DEVICE, max_num_seqs=64, max_num_batched_tokens=512,
              speculative_config={"model": str(head)} | shape)
    assert llm.engine.spec.method == "eagle3"
    import specserve.engine.engine as engine_module
    paths, real = [], engine_module.accepted_path
    monkeypatch.setattr(engine_module, "accepted_path", lambda *a: paths.append(real(*a)) or paths[-1])
    # 6 tokens: room for the whole tree after the first (a budget of 2 truncates it to a chain)
    hist = _token_hist(llm, N_SAMPLES, 200_000, max_tokens=6, seeded=seeded)
    tv = 0.5 * (hist - exact_pairs).abs().sum().item()
    rate = llm.get_stats()["acceptance_rate"]
    assert 0.05 < rate < 0.95                                 # accepts and rejections both seen
    if "speculative_token_tree" in shape:                     # the second-best branch was taken
        assert sum(1 for p in paths if p[:1] == [2]) > 200
    assert tv < TV_BOUND, f"total variation {tv:.3f} from the target's exact distribution"


def test_seeded_spec_is_independent_of_batch(llama_dir, draft_dir):
    cfg = spec_configs(draft_dir)["draft_model"]
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    p = TokensPrompt(prompt_token_ids=repetitive_prompts(1, seed=9)[0])
    alone = LLM(str(llama_dir), speculative_config=cfg, device=DEVICE).generate(
        p, sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [TokensPrompt(prompt_token_ids=q) for q in repetitive_prompts(4, seed=10)]
    mixed = LLM(str(llama_dir), speculative_config=cfg, device=DEVICE).generate(
        others[:2] + [p] + others[2:], [_greedy(), _greedy(), sp, _greedy(), _greedy()],
        use_tqdm=False)[2].outputs[0].token_ids
    assert alone == mixed


def test_stop_string_inside_accepted_run(text_model_dir):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(str(text_model_dir), device=DEVICE)
    free = base.generate("def add(a, b):", sp, use_tqdm=False)[0].outputs[0].text
    stop = free[8:10]
    cfg = {"method": "draft_model", "model": str(text_model_dir), "num_speculative_tokens": 4}
    spec = LLM(str(text_model_dir), speculative_config=cfg, device=DEVICE)
    out = spec.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=40,
                        ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == free[:free.index(stop)] and out.finish_reason == "stop"


def test_vocab_mismatch_is_a_load_error(llama_dir, small_vocab_pair):
    cfg = {"method": "draft_model", "model": str(small_vocab_pair[1]), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocab_size 8 but the target has 96"):
        LLM(str(llama_dir), speculative_config=cfg, device=DEVICE)


def test_past_the_drafts_context_requests_decode_on_without_drafts(llama_dir, tmp_path):
    """A draft model's context (48) limits drafting only, as vLLM's: the request runs to the
    target's context with the output it has without speculation."""
    make_hf_model("llama", tmp_path, seed=5, max_position_embeddings=48, hidden_size=32,
                  num_hidden_layers=1, intermediate_size=64)
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config={
        "method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
    assert llm.engine.max_model_len == 256 and llm.engine.draft_max_len == 48
    last_positions = []                 # the last position each draft step writes
    propose = llm.engine.proposer.propose

    def recording(batch):
        props = propose(batch)
        last_positions.extend(r.num_tokens + len(p.token_ids) - 2
                              for r, p in zip(batch.requests, props))
        return props
    llm.engine.proposer.propose = recording
    prompt = TokensPrompt(prompt_token_ids=list(range(40)))
    ref = LLM(str(llama_dir), device=DEVICE).generate(prompt, _greedy(60), use_tqdm=False)[0]
    out = llm.generate(prompt, _greedy(60), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.outputs[0].token_ids and len(out.token_ids) == 60
    assert last_positions and max(last_positions) <= 47    # inside the draft's 48 positions


def test_synthetic_acceptance(llama_dir):
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
           "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.0}
    llm = LLM(str(llama_dir), speculative_config=cfg, device=DEVICE)
    llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3] * 5), _greedy(), use_tqdm=False)
    assert llm.get_stats()["acceptance_rate"] == 1.0


def test_disable_by_batch_size_keeps_greedy_output(llama_dir, draft_dir):
    cfg = spec_configs(draft_dir)["ngram"] | {"disable_by_batch_size": 3}
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(6, seed=11)]
    ref = LLM(str(llama_dir), device=DEVICE).generate(ps, _greedy(), use_tqdm=False)
    llm = LLM(str(llama_dir), speculative_config=cfg, device=DEVICE)
    got = llm.generate(ps, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    batched_drafts = llm.get_stats()["spec_decode_num_drafts"]
    alone = LLM(str(llama_dir), speculative_config=cfg, device=DEVICE)
    for p in ps:
        alone.generate(p, _greedy(), use_tqdm=False)
    # With 6 requests running, speculation is off until only 2 remain.
    assert batched_drafts < alone.get_stats()["spec_decode_num_drafts"]


def test_spec_max_model_len_limits_drafting_only_for_every_method(llama_dir):
    cfg = {"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 40,
           "prompt_lookup_min": 1}
    llm = LLM(str(llama_dir), speculative_config=cfg, device=DEVICE)
    prompt = TokensPrompt(prompt_token_ids=[3, 4] * 18)            # 36 tokens, all repeats
    out = llm.generate(prompt, _greedy(20), use_tqdm=False)[0].outputs[0]
    ref = LLM(str(llama_dir), device=DEVICE).generate(prompt, _greedy(20), use_tqdm=False)[0]
    assert out.token_ids == ref.outputs[0].token_ids and len(out.token_ids) == 20
    assert llm.get_stats()["spec_decode_num_draft_tokens"] <= 40 - 36
    with pytest.raises(ValueError, match="max_model_len=300 is larger than the target's "
                                         "context \\(256\\)"):
        LLM(str(llama_dir), device=DEVICE, speculative_config=cfg | {"max_model_len": 300})


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_confidence_threshold_keeps_output_and_shortens_drafts(method, llama_dir, draft_dir,
                                                                tmp_path):
    """Drafting stops after the first token the drafter is unsure of: greedy output is
    unchanged and the drafts get shorter as the threshold rises (never empty)."""
    from tests.methods.test_heads import eagle3_ckpt
    model = str(draft_dir) if method == "draft_model" else str(eagle3_ckpt(tmp_path / "e3"))
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(4, seed=3)]
    base = LLM(str(llama_dir), device=DEVICE)
    ref = [o.outputs[0].token_ids for o in base.generate(ps, _greedy(), use_tqdm=False)]
    per_draft = []
    for threshold in (0.0, 0.2, 0.99):
        llm = LLM(str(llama_dir), device=DEVICE, speculative_config={
            "method": method, "model": model, "num_speculative_tokens": K,
            "draft_confidence_threshold": threshold})
        got = [o.outputs[0].token_ids for o in llm.generate(ps, _greedy(), use_tqdm=False)]
        assert got == ref, threshold
        m = llm.get_stats()
        per_draft.append(m["spec_decode_num_draft_tokens"] / m["spec_decode_num_drafts"])
    assert per_draft[0] > 2.5                      # K = 3 except near max_tokens
    assert per_draft[0] >= per_draft[1] >= per_draft[2] >= 1.0
    assert per_draft[2] < per_draft[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_per_request_k_in_one_batch(method, llama_dir, draft_dir):
    """Requests asking for 0, 1, 2 and the engine's K drafts share batches: each gets at most
    its own K per step, none with 0, and every output equals no-spec."""
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(8, seed=5)]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device=DEVICE).generate(
        ps, _greedy(), use_tqdm=False)]
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=spec_configs(draft_dir)[method])
    ks = [0, 1, 2, None] * 2
    outs = llm.generate(ps, [_greedy(num_speculative_tokens=k) for k in ks], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, k in zip(outs, ks):
        m = o.spec_metrics
        if k == 0:
            assert m.num_drafts == 0
        else:
            assert m.num_drafts > 0 and m.num_draft_tokens <= m.num_drafts * (k or K)
    assert max(o.spec_metrics.num_draft_tokens / o.spec_metrics.num_drafts
               for o, k in zip(outs, ks) if k is None) > 2
    with pytest.raises(ValueError, match=f"num_speculative_tokens={K + 1} is more than the "
                                         f"engine's {K}"):
        llm.generate(ps[0], _greedy(num_speculative_tokens=K + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0"):
        _greedy(num_speculative_tokens=-1)


PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=0.8),
             dict(repetition_penalty=1.6), dict(logit_bias={5: 4.0, 7: -100.0}),
             dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.8,
                  logit_bias={11: 2.0})]


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "hybrid"])
def test_penalties_and_bias_are_lossless(method, llama_dir, draft_dir):
    """Each verify row is penalized with the counts of the output and the drafts before it:
    greedy outputs equal no-spec's under the same penalties, alone and in one batch, and they
    differ from the unpenalized output (the penalties act); seeded samples: `test_seeded_*`."""
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(len(PENALTIES), seed=4)]
    greedy = [_greedy(**kw) for kw in PENALTIES]
    base = LLM(str(llama_dir), device=DEVICE)
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=spec_configs(draft_dir)[method])
    ref = [o.outputs[0].token_ids for o in base.generate(ps, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)] == ref
    assert [llm.generate(p, g, use_tqdm=False)[0].outputs[0].token_ids
            for p, g in zip(ps, greedy)] == ref
    plain = [o.outputs[0].token_ids for o in base.generate(ps, _greedy(), use_tqdm=False)]
    assert all(a != b for a, b in zip(plain, ref))
    assert llm.get_stats()["spec_decode_num_accepted_tokens"] > 0
    biased = base.generate(ps[0], _greedy(logit_bias={7: 100.0}), use_tqdm=False)[0]
    assert set(biased.outputs[0].token_ids) == {7}


@pytest.mark.parametrize("kw, message", [
    (dict(presence_penalty=3), "presence_penalty must be in"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={1: 101.0}), "logit_bias values must be in"),
])
def test_bad_penalties_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _greedy(**kw)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_n_samples_are_seed_plus_i(method, llama_dir, draft_dir):
    """SamplingParams(n=3, seed=s): three completions, sample i as the request seeded s + i;
    greedy n gives n equal completions equal to no-spec's."""
    p = TokensPrompt(prompt_token_ids=repetitive_prompts(1, seed=6)[0])
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=spec_configs(draft_dir)[method])
    out = llm.generate(p, SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=20,
                                         ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    one = [llm.generate(p, SamplingParams(temperature=0.9, seed=11 + i, max_tokens=20,
                                          ignore_eos=True), use_tqdm=False)[0]
           .outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == one and len({tuple(x) for x in one}) > 1
    ref = LLM(str(llama_dir), device=DEVICE).generate(p, _greedy(), use_tqdm=False)[0]
    greedy = llm.generate(p, _greedy(n=2), use_tqdm=False)[0]
    assert [c.token_ids for c in greedy.outputs] == [ref.outputs[0].token_ids] * 2


def test_logprobs_are_the_models_under_penalties(llama_dir):
    """logprobs report the model's distribution (vLLM's default), not the penalized one."""
    p = TokensPrompt(prompt_token_ids=repetitive_prompts(1, seed=8)[0])
    llm = LLM(str(llama_dir), device=DEVICE)
    plain = llm.generate(p, _greedy(max_tokens=1, logprobs=0), use_tqdm=False)[0].outputs[0]
    biased = llm.generate(p, _greedy(max_tokens=1, logprobs=0, logit_bias={3: 50.0}),
                          use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [3] != plain.token_ids
    assert biased.logprobs[0][3] < plain.logprobs[0][plain.token_ids[0]]


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "hybrid", "tree"])
def test_seeded_samples_equal_no_spec(method, llama_dir, draft_dir, tmp_path):
    """A seeded sampled request gives the same tokens with and without speculation (coupled
    verification: each position's draw is fixed by the seed), under penalties and bias, in a
    batch and alone, as the n samples of one request, and with K varied per request."""
    from tests.methods.test_heads import eagle3_ckpt
    spec = (spec_configs(draft_dir)[method] if method != "tree" else
            {"model": str(eagle3_ckpt(tmp_path / "e3")),
             "speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"})
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(len(PENALTIES) + 3, seed=8)]
    params = [_seeded(i, **kw) for i, kw in enumerate(PENALTIES + [{}, {}, {}])]
    base = LLM(str(llama_dir), device=DEVICE)
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=spec)
    ref = [o.outputs[0].token_ids for o in base.generate(ps, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == ref
    assert llm.generate(ps[1], params[1], use_tqdm=False)[0].outputs[0].token_ids == ref[1]
    assert llm.get_stats()["spec_decode_num_accepted_tokens"] > 0
    n3 = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=20, ignore_eos=True)
    assert ([c.token_ids for c in llm.generate(ps[2], n3, use_tqdm=False)[0].outputs]
            == [c.token_ids for c in base.generate(ps[2], n3, use_tqdm=False)[0].outputs])
    if method != "tree":
        ks = [_seeded(i, num_speculative_tokens=[0, 1, None][i % 3]) for i in range(len(ps))]
        ref = [o.outputs[0].token_ids for o in base.generate(
            ps, [_seeded(i) for i in range(len(ps))], use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(ps, ks, use_tqdm=False)] == ref
    # the seed decides: another seed gives other tokens
    other = base.generate(ps[0], _seeded(99), use_tqdm=False)[0].outputs[0].token_ids
    assert other != base.generate(ps[0], _seeded(0), use_tqdm=False)[0].outputs[0].token_ids
