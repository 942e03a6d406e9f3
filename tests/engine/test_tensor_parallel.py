"""Tensor parallelism over 2 gloo ranks on the CPU: the same logits and greedy output as one
rank for every architecture and the main methods, the drafter on rank 0, the server, errors
that say what to change, and no worker left behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import openai
import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.engine.tensor_parallel import (
    LeadLayer,
    ShardedModel,
    WorkerDied,
    _free_port,
)
from specserve.kernels.cpu import (
    SharedMemoryAllReduce,
    SharedMemoryChannel,
    load_library,
    max_rows,
    shm_numel,
)
from specserve.models.cpu_backend import KernelLayer
from specserve.models.llama import DecoderLayer
from specserve.models.metadata import build_metadata
from tests.test_spec_decode import _greedy, repetitive_prompts
from tests.train.conftest import REPO

ZOO = REPO / "models"

TP = 2


def worker_pids() -> list[int]:
    """PIDs of live tensor-parallel worker processes on this machine (specserve.engine.worker),
    whoever started them."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"specserve.engine.worker" in cmd and state != "Z":
            pids.append(int(d.name))
    return pids


def _gone(pids: list[int], timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while set(pids) & set(worker_pids()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    yield
    gc.collect()
    assert _gone(worker_pids(), timeout=10)
    assert not list(Path("/dev/shm").glob("specserve-tp-*"))


def _logprobs(llm: LLM, prompts) -> list[list[dict[int, float]]]:
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    return [o.outputs[0].logprobs for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_two_ranks_give_one_ranks_logits_for_every_architecture(hf_model):
    arch, path, _ = hf_model
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(2, seed=1)]
    want = _logprobs(LLM(str(path), device="cpu"), ps)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=TP)
    if load_library() is not None:      # each layer's halves in the kernel, summed in memory
        layer = llm.engine.model.layers[0]
        assert isinstance(layer, KernelLayer) and layer.cpu_layer is not None
        assert isinstance(layer.all_reduce, SharedMemoryAllReduce)
    got = _logprobs(llm, ps)
    llm.engine.close()
    for g, w in zip(got, want):
        assert [list(x) for x in g] == [list(x) for x in w], arch        # the same top tokens
        for gx, wx in zip(g, w):
            assert gx == pytest.approx(wx, abs=1e-4), arch             # float32 sum order


def test_an_int8_target_has_the_same_int8_weights_on_two_ranks(llama_dir):
    """A shard of o_proj's or down_proj's inputs is quantized with its whole column's scale:
    the ranks' int8 values are one rank's, and the logits differ only by summation order."""
    if load_library() is None:
        pytest.skip("no C compiler: int8 runs in the CPU kernel")
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(2, seed=5)]
    kw = {"device": "cpu", "quantization": "int8"}
    want = _logprobs(LLM(str(llama_dir), **kw), ps)
    llm = LLM(str(llama_dir), tensor_parallel_size=TP, **kw)
    got = _logprobs(llm, ps)
    llm.engine.close()
    for g, w in zip(got, want):
        assert [list(x) for x in g] == [list(x) for x in w]
        for gx, wx in zip(g, w):
            assert gx == pytest.approx(wx, abs=1e-4)


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "draft_model_sharded",
                                    "eagle3"])
def test_greedy_output_with_two_ranks_is_one_ranks(method, llama_dir, draft_dir, tmp_path):
    from tests.methods.test_heads import eagle3_ckpt
    spec = {"none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
            "draft_model": {"model": str(draft_dir), "num_speculative_tokens": 3},
            "draft_model_sharded": {"model": str(draft_dir), "num_speculative_tokens": 3,
                                    "draft_tensor_parallel_size": TP},
            "eagle3": {"model": str(eagle3_ckpt(tmp_path / "e3")), "num_speculative_tokens": 3,
                       "draft_tensor_parallel_size": 1}}[method]
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(5, seed=2)]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device="cpu").generate(
        ps, _greedy(30), use_tqdm=False)]
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP, max_num_seqs=3,
              max_num_batched_tokens=16, speculative_config=spec)   # chunks, continuous batching
    assert [o.outputs[0].token_ids for o in llm.generate(ps, _greedy(30), use_tqdm=False)] == ref
    if method == "draft_model_sharded":          # rank 0 holds half the draft's KV heads
        draft = llm.engine.proposer.model
        assert isinstance(draft, ShardedModel) and draft.tp_size == TP
        assert (llm.engine.proposer.cache.layers[0][0].shape[1]
                == draft.args.num_key_value_heads // TP)
    if method != "none":
        assert llm.get_stats()["spec_decode_num_drafts"] > 0
    llm.engine.close()


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_tree", "peagle", "mtp", "eagle_gloo"])
def test_a_sharded_head_drafts_what_the_whole_head_drafts(kind, llama_dir, tmp_path):
    """draft_tensor_parallel_size = 2: every rank holds half of the head's attention and MLP
    and runs each of its steps (chains, trees, P-EAGLE's one pass, MTP's layers in turn; in the
    kernel, and over gloo without it); the drafts are the whole head's on one rank."""
    from tests.methods.test_heads import (
        eagle3_ckpt,
        eagle_ckpt,
        mtp_target,
        record_drafts,
    )
    from tests.methods.test_peagle import make_peagle
    target, kw = llama_dir, {"device": "cpu"}
    spec = {"num_speculative_tokens": 3}
    if kind.startswith("eagle3"):
        spec["model"] = str(eagle3_ckpt(tmp_path / "e3"))
        if kind == "eagle3_tree":
            spec |= {"num_speculative_tokens": 4,
                     "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1)]"}
    elif kind == "peagle":
        spec |= {"model": str(make_peagle(llama_dir, tmp_path / "pe")),
                 "parallel_drafting": True}
    elif kind == "mtp":
        target = mtp_target(tmp_path / "mtp", layers=2)
        spec |= {"method": "mtp", "num_speculative_tokens": 4}
    else:
        spec["model"], kw["cpu_kernel"] = str(eagle_ckpt(tmp_path / "eagle")), False
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(3, seed=4)]
    ref = [o.outputs[0].token_ids for o in LLM(str(target), **kw).generate(
        ps, _greedy(24), use_tqdm=False)]
    runs = {}
    for size in (1, TP):
        llm = LLM(str(target), tensor_parallel_size=size, speculative_config=spec | {
            "draft_tensor_parallel_size": size}, **kw)
        drafts = record_drafts(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(ps, _greedy(24),
                                                             use_tqdm=False)] == ref
        runs[size] = drafts
        proposer = llm.engine.proposer
        if size == TP:                  # rank 0 holds half the head's KV heads
            assert proposer.head.tp_size == TP
            assert all(isinstance(m, LeadLayer) for m in proposer.head.modules()
                       if isinstance(m, DecoderLayer))
            assert (proposer.cache.layers[0][0].shape[1]
                    == proposer.head.args.num_key_value_heads // TP)
        llm.engine.close()
    assert sum(map(len, runs[1])) > 10
    assert runs[TP] == runs[1]


def test_a_prompt_chunk_longer_than_a_kernel_step_sums_over_shared_memory_too(tmp_path):
    """Past the kernel's longest step a shard's layers run in PyTorch (their matrix products
    still in the kernel), their partial sums through the same shared memory."""
    from tests.conftest import make_hf_model
    if load_library() is None:
        pytest.skip("no C compiler: the CPU kernel cannot be built here")
    make_hf_model("llama", tmp_path, max_position_embeddings=1024)
    n = max_rows(load_library()) + 40
    ps = [TokensPrompt(prompt_token_ids=(list(range(3, 90)) * 20)[:n])]
    kw = {"device": "cpu", "max_model_len": n + 16, "max_num_batched_tokens": n}
    ref = LLM(str(tmp_path), **kw).generate(ps, _greedy(8), use_tqdm=False)
    llm = LLM(str(tmp_path), tensor_parallel_size=TP, **kw)
    out = llm.generate(ps, _greedy(8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert isinstance(llm.engine.model.layers[0].all_reduce, SharedMemoryAllReduce)
    llm.engine.close()


def test_without_the_kernel_the_ranks_sum_over_gloo(llama_dir):
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(3, seed=3)]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device="cpu").generate(
        ps, _greedy(20), use_tqdm=False)]
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP, cpu_kernel=False)
    layer = llm.engine.model.layers[0]
    assert not isinstance(layer, KernelLayer)
    assert not isinstance(layer.all_reduce, SharedMemoryAllReduce)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, _greedy(20), use_tqdm=False)] == ref
    llm.engine.close()


def _rank1(shm: torch.Tensor, step_shm: torch.Tensor, cap: int, xs: list[torch.Tensor],
           results) -> None:
    lib = load_library()
    reduce = SharedMemoryAllReduce(lib, shm, 1, 2, cap, lambda: None)
    for x in xs:
        reduce(x)
        results.put(x)
    channel = SharedMemoryChannel(lib, step_shm, lambda: None)
    while data := channel.receive():
        results.put(data)
    results.put(b"")


def test_shared_memory_sums_and_messages_between_two_processes():
    """Every rank gets the same bits (the posts summed in rank order), tensors longer than
    the room go in parts, and the channel delivers each message whole, the empty one too."""
    if load_library() is None:
        pytest.skip("no C compiler: the CPU kernel cannot be built here")
    lib, cap = load_library(), 1000
    shm = torch.zeros(shm_numel(2, cap), dtype=torch.int64).share_memory_()
    step_shm = torch.zeros(SharedMemoryChannel.HEADER + 10_000, dtype=torch.uint8).share_memory_()
    g = torch.Generator().manual_seed(0)
    mine = [torch.randn(n, generator=g) for n in (7, 2500, 1000)]
    theirs = [torch.randn(n, generator=g) for n in (7, 2500, 1000)]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    peer = ctx.Process(target=_rank1, args=(shm, step_shm, cap, [t.clone() for t in theirs],
                                            results))
    peer.start()
    reduce = SharedMemoryAllReduce(lib, shm, 0, 2, cap, lambda: None)
    for a, b in zip(mine, theirs):
        x = a.clone()
        reduce(x)
        assert torch.equal(x, a + b) and torch.equal(results.get(timeout=60), x)
    channel = SharedMemoryChannel(lib, step_shm, lambda: None)
    for message in (b"one step", bytes(range(256)) * 39, b"x", b""):
        channel.send(message)
        assert results.get(timeout=60) == message    # read before the next one is sent
    peer.join(timeout=60)
    assert peer.exitcode == 0
    with pytest.raises(ValueError, match="does not fit"):
        channel.send(bytes(10_001))


def test_a_rank_that_never_posts_is_checked_for_not_waited_for_forever():
    """The wait ends (after the all-reduce's bound, or each channel poll) and check_peers
    names the rank that is gone; with no rank gone, the all-reduce says none came."""
    if load_library() is None:
        pytest.skip("no C compiler: the CPU kernel cannot be built here")
    shm = torch.zeros(shm_numel(2, 8), dtype=torch.int64).share_memory_()
    checks = []

    def check_peers():
        checks.append(1)
        if len(checks) == 3:
            raise RuntimeError("rank 1 is gone")

    reduce = SharedMemoryAllReduce(load_library(), shm, 0, 2, 8, check_peers, timeout_s=0.01)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="did not come to an all-reduce within"):
            reduce(torch.ones(8))
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        reduce(torch.ones(8))
    channel = SharedMemoryChannel(load_library(), torch.zeros(100, dtype=torch.uint8)
                                  .share_memory_(), check_peers, poll_s=0.01)
    checks.clear()
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        channel.receive()


def test_ranks_that_torchrun_starts_serve_rank_0s_engine(llama_dir, tmp_path):
    """The same script on every rank, started by torchrun (as across machines): rank 0 runs
    the engine, rank 1 serves it inside LLM(...) and ends its process when rank 0 closes."""
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        from specserve import LLM, SamplingParams, TokensPrompt
        llm = LLM({str(llama_dir)!r}, device="cpu", tensor_parallel_size=2)
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        print("TOKENS", out[0].outputs[0].token_ids)
        llm.engine.close()
    """))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), str(script)],
                       capture_output=True, text=True, timeout=300,
                       env=os.environ | {"PYTHONFAULTHANDLER": "1"})   # a crash shows where
    assert r.returncode == 0, r.stderr[-3000:]
    ref = LLM(str(llama_dir), device="cpu").generate(
        [TokensPrompt(prompt_token_ids=[5, 6, 7])], _greedy(12), use_tqdm=False)
    assert r.stdout.count("TOKENS") == 1             # rank 1 never returned from LLM(...)
    assert f"TOKENS {ref[0].outputs[0].token_ids}" in r.stdout


# The seeds' offline EAGLE example as users write it: module level, no main guard.
SEED_EXAMPLE = textwrap.dedent(f"""
    from specserve import LLM, SamplingParams
    llm = LLM(model={str(ZOO / "code-target")!r}, tensor_parallel_size=2, speculative_config={{
        "model": {str(ZOO / "code-target-eagle3")!r}, "draft_tensor_parallel_size": 1,
        "num_speculative_tokens": 2, "method": "eagle3"}})
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=24))
    print("TOKENS", out[0].outputs[0].token_ids)
    print("TAU", llm.get_stats()["mean_acceptance_length"])
""")


@pytest.fixture(scope="module")
def one_rank_tokens() -> list[int]:
    out = LLM(model=str(ZOO / "code-target")).generate(
        ["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("how", ["script", "python -c"])
def test_the_seeds_eagle_example_runs_as_written_on_two_ranks(how, tmp_path, one_rank_tokens):
    """No `if __name__ == "__main__":`: the workers are processes of their own, which never
    import the caller's script."""
    script = tmp_path / "eagle_example.py"
    script.write_text(SEED_EXAMPLE)
    cmd = [sys.executable, str(script)] if how == "script" else [sys.executable, "-c",
                                                                 SEED_EXAMPLE]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("TOKENS") == 1, r.stdout           # the script ran once
    assert f"TOKENS {one_rank_tokens}" in r.stdout
    assert float(r.stdout.split("TAU")[1]) > 1.2


def test_serve_command_on_two_ranks_answers_the_openai_client(one_rank_tokens):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve",
                             str(ZOO / "code-target"), "--port", str(port),
                             "--tensor-parallel-size", "2", "--speculative-config",
                             '{"model": "%s", "draft_tensor_parallel_size": 1, '
                             '"num_speculative_tokens": 2}' % (ZOO / "code-target-eagle3")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                r = client.completions.create(model=str(ZOO / "code-target"),
                                              prompt="def fibonacci(n):", temperature=0,
                                              max_tokens=24)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        ref = LLM(model=str(ZOO / "code-target")).get_tokenizer().decode(one_rank_tokens)
        assert r.choices[0].text == ref
        assert len(worker_pids()) == 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert _gone(worker_pids())


def test_no_worker_survives_rank_0_killed(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from specserve import LLM
        llm = LLM(model={str(ZOO / "code-target")!r}, tensor_parallel_size=2)
        print("PIDS", [w.pid for w in llm.engine.executor.tp.workers], flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split("[")[1].rstrip("]\n").split(",")]
    assert set(pids) <= set(worker_pids())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone(pids), f"workers {pids} outlived rank 0"


def test_the_server_answers_on_two_ranks(text_model_dir):
    from tests.server.test_server import NAME, live_server
    with live_server(text_model_dir, max_model_len=128, tensor_parallel_size=TP) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=NAME, prompt="def add(a, b):", temperature=0,
                                      max_tokens=12)
    ref = LLM(str(text_model_dir), device="cpu", max_model_len=128).generate(
        "def add(a, b):", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert r.choices[0].text == ref[0].outputs[0].text


def test_sizes_that_cannot_split_the_model_are_refused_before_any_process(llama_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's 4 "
                                         r"attention heads; use one of \[1, 2\]"):
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="must be 1 or equal to tensor_parallel_size=2"):
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="shards the drafters of draft_model, eagle3, eagle, "
                                         "mtp only; 'medusa' runs whole on rank 0"):
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, speculative_config={
            "method": "medusa", "model": str(llama_dir), "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 2})
    assert worker_pids() == []


def test_a_worker_that_dies_stops_the_engine_with_a_message(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP)
    llm.engine.executor.tp.workers[0].kill()
    llm.engine.executor.tp.workers[0].join()
    with pytest.raises(RuntimeError, match="tensor-parallel worker specserve-tp-rank1 died"):
        llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]), _greedy(4), use_tqdm=False)
    llm.engine.close()


def test_a_worker_that_dies_mid_step_is_noticed_inside_the_step(llama_dir):
    """Rank 0 waiting inside its one-call step for a worker's partial sums finds the worker
    gone (the C side looks) instead of waiting out the bound it gives a slow rank."""
    if load_library() is None:
        pytest.skip("no C compiler: the CPU kernel cannot be built here")
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP)
    llm.engine.executor.tp.workers[0].kill()
    llm.engine.executor.tp.workers[0].join()
    md, positions = build_metadata([0], [3], [0], torch.device("cpu"))
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="specserve-tp-rank1 died during a step"):
        with torch.inference_mode():
            llm.engine.model(torch.tensor([1, 2, 3]), positions, md, llm.engine.cache.layers)
    assert time.monotonic() - start < SharedMemoryAllReduce.TIMEOUT_S / 4
    llm.engine.close()


def test_workers_stop_when_the_engine_is_collected(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP)
    workers = list(llm.engine.executor.tp.workers)
    assert all(w.is_alive() for w in workers)
    del llm
    gc.collect()
    assert not any(w.is_alive() for w in workers)
