"""GGUF files: tiny models written as llama.cpp's converter writes them load and compute what
transformers computes; every tensor type reads as gguf dequantizes it; SmolLM2's GGUF (pulled
from the package registry) matches transformers' own GGUF load, tokenizer and chat template."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from specserve.models.gguf import gguf_path, open_gguf
from specserve.models.loader import load_model, load_tokenizer
from tests.conftest import make_hf_model
from tests.models.gguf_writer import (
    RAW_ONLY,
    random_blocks,
    write_gguf,
    write_sentencepiece_gguf,
)

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *RAW_ONLY]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_of_each_architecture_computes_what_transformers_does(arch, tmp_path):
    over = {"rope_parameters": DEFAULT_ROPE} if arch == "llama" else {}
    hf = make_hf_model(arch, tmp_path / "hf", **over)
    path = write_gguf(hf, tmp_path / "m.gguf", arch)
    model = load_model(path, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert (_logits(model, ids) - ref).abs().max() < 1e-4


def test_quantized_gguf_matches_transformers_gguf_load(tmp_path):
    from transformers import AutoModelForCausalLM
    hf = make_hf_model("llama", tmp_path / "hf", rope_parameters=DEFAULT_ROPE)
    path = write_gguf(hf, tmp_path / "m.gguf", "llama", "Q8_0")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    assert (_logits(load_model(path, torch.float32, torch.device("cpu")), ids) - expected
            ).abs().max() < 1e-4
    # a directory holding one GGUF is the same model
    assert gguf_path(tmp_path) == path


@pytest.mark.parametrize("qtype", TYPES)
def test_each_tensor_type_reads_as_gguf_dequantizes_it(qtype, tmp_path):
    q = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    if qtype in RAW_ONLY:
        data = random_blocks(values.shape, q, 0)
    elif qtype == "F32":
        data = values
    else:
        data = quantize(values, q)
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=None if qtype == "F32" else q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = open_gguf(tmp_path / "t.gguf")
    name, tensor = next(g.tensors(torch.float32))
    assert name == "model.layers.0.mlp.up_proj.weight"
    expected = dequantize(GGUFReader(str(tmp_path / "t.gguf")).tensors[0].data, q)
    assert tensor.shape == (4, 512)
    assert torch.equal(tensor, torch.from_numpy(np.array(expected)))


def test_unsupported_architecture_and_tensor_are_named(tmp_path):
    w = GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gemma2' is not supported; supported: llama, qwen2"):
        load_model(tmp_path / "g.gguf", torch.float32, torch.device("cpu"))
    # a tensor the reader does not know is an error, never dropped
    bad = tmp_path / "bad"
    bad.mkdir()
    w = GGUFWriter(str(bad / "m.gguf"), "llama")
    w.add_tensor("blk.0.ssm_conv1d.weight", np.zeros(3, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.ssm_conv1d.weight' is not supported"):
        list(open_gguf(bad / "m.gguf").tensors(torch.float32))


def test_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path):
    """Merges recovered from the scores, byte fallback, BOS added (llama.cpp's default for
    SentencePiece vocabularies)."""
    from transformers import AutoTokenizer
    path = write_sentencepiece_gguf(tmp_path / "sp.gguf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tok = load_tokenizer(path)
    for text in ("the cat", "the cat sat on the hat", "héllo 🙂", "a\nb  c"):
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    # a leading space: llama.cpp (and specserve) keep it, as "▁▁"; transformers drops it
    assert tok.decode(tok.encode(" the")) == " the"


# --- SmolLM2-135M-Instruct, pulled once into the cache -------------------------------------

PROMPTS = ["Write a haiku about the sea.", "What is the capital of Japan?",
           "Explain recursion in one sentence.", "List three fruits.",
           "How do I reverse a list in Python?", "Tell me a joke about cats.",
           "What is photosynthesis?", "Translate 'good morning' to French."]
TEXTS = ["Hello world", "  two  spaces\n\nnewlines\ttab  ", "Numbers 12345 and 3.14159",
         "héllo wörld 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
         "def f(x):\n    return x**2  # square", "I'm 100% sure it's 2026-11-27.", "",
         " leading space", "trailing newline\n", "MiXeD CaSe ÀÉÎ", "\u200b zero width"]


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                 dtype=torch.float32).eval()
    return tok, model


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2, smollm2_hf):
    ref, _ = smollm2_hf
    tok = load_tokenizer(smollm2)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "é?"}]):
        text = tok.apply_chat_template(msgs)
        assert text == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tok.encode(text) == ref.apply_chat_template(msgs, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False)
    assert tok.eos_token == "<|im_end|>" and not tok.add_bos
    # The `smollm` pre-tokenizer splits off every number character (llama.cpp's regex \p{N},
    # SmolLM's Digits step); transformers' GGUF reader keeps GPT-2's " ?\p{N}+" for it, so the
    # two part on a space before a numeral other than 0-9:
    half = tok.encode(" ½")
    assert [tok.decode([i]) for i in half] == [" ", "½"]


def test_smollm2_matches_transformers_gguf_load(smollm2, smollm2_hf):
    """Logits close, and 48 greedy tokens (or up to EOS) equal on 8 chat prompts."""
    from specserve import LLM, SamplingParams, TokensPrompt
    _, ref = smollm2_hf
    llm = LLM(model=str(smollm2), dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    with torch.no_grad():
        expected = ref(torch.tensor([ids[0]])).logits[0]
    model = load_model(smollm2, torch.float32, torch.device("cpu"))
    assert (_logits(model, torch.tensor([ids[0]])) - expected).abs().max() < 1e-3
    outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids],
                        SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    equal = 0
    for i, out in zip(ids, outs):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([i]), max_new_tokens=48, do_sample=False)
        equal += out.outputs[0].token_ids == gen[0, len(i):].tolist()
    assert equal == len(PROMPTS)


def test_transformers_5_directory_of_smollm2_chats_like_its_gguf(smollm2, smollm2_hf, tmp_path):
    """Written back out by transformers 5 (chat_template.jinja, rope_parameters), the model
    loads as a directory and answers a chat as the GGUF does."""
    from transformers import LlamaForCausalLM

    from specserve import LLM, SamplingParams
    tok, model = smollm2_hf
    # transformers refuses to save a model it read from GGUF; the same weights in a new model
    config = copy.deepcopy(model.config)
    config.quantization_config = None
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "rope_parameters" in (tmp_path / "config.json").read_text()
    msgs = [{"role": "user", "content": "Name a planet."}]
    params = SamplingParams(temperature=0, max_tokens=16)
    from_dir = LLM(model=str(tmp_path), dtype="float32", device="cpu").chat(msgs, params)
    from_gguf = LLM(model=str(smollm2), dtype="float32", device="cpu").chat(msgs, params)
    assert from_dir[0].outputs[0].token_ids == from_gguf[0].outputs[0].token_ids


def test_a_gguf_draft_model_speculates_losslessly(llama_dir, tmp_path):
    from specserve import LLM, SamplingParams, TokensPrompt
    draft = make_hf_model("llama", tmp_path / "hf", seed=1, hidden_size=32, num_hidden_layers=1,
                          intermediate_size=64, rope_parameters=DEFAULT_ROPE)
    path = write_gguf(draft, tmp_path / "draft.gguf", "llama", "Q8_0")
    prompts = [TokensPrompt(prompt_token_ids=[i + 1, 2 * i + 3, 5]) for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(str(llama_dir), device="cpu").generate(prompts, greedy, use_tqdm=False)
    llm = LLM(str(llama_dir), device="cpu", speculative_config={
        "model": str(path), "num_speculative_tokens": 3})
    assert llm.engine.spec.method == "draft_model"
    out = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
