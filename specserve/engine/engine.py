"""LLMEngine.step(): schedule -> run the target -> verify/sample -> update -> propose."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from pathlib import Path

import torch

from specserve.config import EngineConfig, resolve_device, resolve_dtype
from specserve.engine.adaptive_k import AdaptiveK
from specserve.engine.executor import make_executor
from specserve.engine.prefix_cache import PREFIX_BLOCK_SIZE, PrefixCache
from specserve.engine.request import Request, RequestStatus
from specserve.engine.runner import ModelRunner, RunnerOutput
from specserve.engine.scheduler import ScheduledRequest, Scheduler
from specserve.engine.structured_output import Grammars
from specserve.methods import (
    DraftContext,
    Proposal,
    ProposeBatch,
    Proposer,
    build_proposer,
)
from specserve.metrics import SpecDecodingStats
from specserve.models.backend import Backend
from specserve.models.catalogue import resolve_model
from specserve.models.loader import load_hf_config, load_tokenizer, read_json
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling.penalties import apply_penalties, needs_processing
from specserve.sampling.rejection import PLACEHOLDER_TOKEN_ID, VerifyRequest, verify
from specserve.sampling.sampler import token_logprobs
from specserve.sampling_params import SamplingParams
from specserve.token_tree import accepted_path, draft_paths
from specserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("specserve")


def _eos_ids(model_dir: str, cfg: dict, tokenizer: Tokenizer | None) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json (a GGUF's metadata) and the tokenizer."""
    ids: set[int] = set()
    gen_path = Path(model_dir) / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    for src in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(src)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        mc = dataclasses.replace(mc, model=resolve_model(mc.model))
        config = dataclasses.replace(config, model_config=mc)
        self.config = config
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype)
        hf = load_hf_config(mc.model)
        model_len = hf.get("max_position_embeddings", 2048)
        if mc.max_model_len is not None and mc.max_model_len > model_len:
            raise ValueError(f"max_model_len={mc.max_model_len} is larger than the model's "
                             f"context ({model_len}, max_position_embeddings in config.json)")
        self.max_model_len = mc.max_model_len or model_len
        self.tokenizer = load_tokenizer(mc.model)
        self.backend = Backend(self.device, self.dtype, mc.cpu_kernel,
                               cuda_graphs=self.device.type == "cuda" and not mc.enforce_eager,
                               quantization=mc.quantization)
        sc = config.scheduler_config
        self.spec = config.speculative_config
        self.executor = make_executor(mc, self.spec, self.backend, self.max_model_len,
                                      sc.max_num_seqs, hf)
        self.model = self.executor.load_target()
        self.vocab_size = self.model.args.vocab_size
        self.eos_token_ids = _eos_ids(mc.model, hf, self.tokenizer)
        self.cache = self.executor.kv_cache(self.model)
        self.runner = ModelRunner(self.model, self.cache, self.device,
                                  self.backend.graphs(self.model, self.cache, sc.max_num_seqs),
                                  self.executor.before_step)
        self.proposer: Proposer | None = None
        caches = [self.cache]
        # The drafter's context (speculative max_model_len, a draft model's own): past it a
        # request decodes on without drafts. None: the target's.
        self.draft_max_len: int | None = None
        if self.spec is not None:
            draft_backend = dataclasses.replace(self.backend, quantization=self.spec.quantization)
            self.proposer = build_proposer(self.spec, DraftContext(
                target=self.model, target_path=mc.model, num_slots=sc.max_num_seqs,
                max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                backend=draft_backend, **self.executor.draft_hooks(self.spec, draft_backend)))
            self.draft_max_len = self._draft_max_len(self.spec.max_model_len,
                                                     self.proposer.max_model_len)
            caches += self.proposer.caches
            self.runner.aux_layers = self.proposer.aux_hidden_layers
        self.prefix_cache, prefix_note = self._prefix_cache(sc, caches)
        self.scheduler = Scheduler(sc, caches, self._admit if self.prefix_cache else None)
        parts = [f"target {self.backend.describe(self.model)}"] + [
            f"{role} {self.backend.describe(m)}"
            for role, m in (self.proposer.modules if self.proposer else {}).items()]
        if self.spec is not None and self.spec.auto_choice:
            parts.append(f"method auto: {self.spec.auto_choice}")
        self.backend_line = "; ".join(parts)    # which path each model's steps take
        logger.info("backend: %s; %s, %d threads; %s", self.backend_line, mc.dtype,
                    torch.get_num_threads(), prefix_note)
        self.num_spec_tokens = self.spec.num_speculative_tokens if self.spec else 0
        self.verify_method = self.spec.rejection_sample_method if self.spec else "strict"
        self.synthetic_rates = self.spec.synthetic_rates() if self.spec else None
        self.spec_stats = SpecDecodingStats(self.num_spec_tokens)
        self.adaptive_k = (AdaptiveK(self.num_spec_tokens)
                           if self.spec is not None and self.spec.adaptive_k else None)
        eos = (self.tokenizer.eos_token_id if self.tokenizer is not None else None)
        self.grammars = Grammars(self.tokenizer, self.vocab_size,
                                 eos if eos is not None else min(self.eos_token_ids, default=None))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._start = time.monotonic()
        self._last_log = self._start
        if mc.freeze_gc:        # opt-in: it is process-wide (see ModelConfig.freeze_gc)
            gc.collect()
            gc.freeze()

    def _prefix_cache(self, sc, caches: list) -> tuple[PrefixCache | None, str]:
        """The prefix cache over `caches` (None where it is off or cannot run) and the backend
        line's note on it."""
        if not sc.enable_prefix_caching:
            return None, "prefix caching off"
        why = self.executor.no_prefix_caching
        if why is None and self.proposer is not None and not getattr(
                self.proposer, "reuses_prefix", False):
            why = (f"the {self.spec.method} proposer cannot resume from cached prefix KV "
                   "(reuses_prefix is false)")
        if why is not None:
            return None, f"prefix caching off: {why}"
        pc = PrefixCache(caches, PREFIX_BLOCK_SIZE, sc.prefix_caching_max_tokens)
        return pc, (f"prefix caching on ({pc.num_blocks * pc.block_size} tokens in blocks of "
                    f"{pc.block_size}, {pc.nbytes() / 2**20:.0f} MiB at most)")

    def _admit(self, req: Request) -> None:
        """A request got its slot: start it after the longest cached prefix of its prompt."""
        if req.prompt_logprobs is not None:          # every prompt position is needed
            return
        n = self.prefix_cache.lookup(req.prompt_token_ids, req.slot)
        if n:
            req.num_computed_tokens = req.num_cached_tokens = n
            if self.proposer is not None:
                self.proposer.resume_prefix(req, n)

    def _store_prefix(self, req: Request) -> None:
        """Offer the request's verified positions (its KV and the drafters') to the cache."""
        valid = req.num_computed_tokens
        if self.proposer is not None:
            drafter = self.proposer.prefix_positions(req)
            valid = valid if drafter is None else min(valid, drafter)
        self.prefix_cache.insert(req.all_token_ids, valid, req.slot)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`: a benchmark repeating its
        prompts)."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done when the engine is collected)."""
        self.executor.close()
        if self.config.model_config.freeze_gc:
            # frozen objects are never collected: its tensors would stay resident for good
            gc.unfreeze()

    def _draft_max_len(self, given: int | None, drafter: int | None) -> int | None:
        """speculative max_model_len: at most the target's and the drafter's own (vLLM's
        rule); by default the drafter's."""
        for limit, whose in ((self.max_model_len, "the target's context"),
                             (drafter, "the drafter's own context")):
            if given is not None and limit is not None and given > limit:
                raise ValueError(f"speculative_config max_model_len={given} is larger than "
                                 f"{whose} ({limit}); give at most {limit} or leave it out")
        limit = given if given is not None else drafter
        return limit if limit is not None and limit < self.max_model_len else None

    # ---- requests -------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, checked (ValueError with the fix: the server's 400 text)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (no tokenizer.json); give token "
                                 "ids as the prompt: TokensPrompt(prompt_token_ids=[...]) "
                                 "offline, a list of ids over HTTP")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the context length "
                             f"(max_model_len) is {self.max_model_len}: shorten the prompt so "
                             "that at least one token can be generated")
        return ids

    def check_params(self, params: SamplingParams, whose_k: str = "the engine's"):
        """What of `params` only this engine can check (ValueError with the fix: the server's
        400 text): K at most its own, token ids inside its vocabulary, the grammar. Returns
        the grammar's matcher (None without structured output)."""
        k = params.num_speculative_tokens
        if k and k > self.num_spec_tokens:
            raise ValueError(f"num_speculative_tokens={k} is more than {whose_k} "
                             f"{self.num_spec_tokens} (speculative_config "
                             "num_speculative_tokens); give at most that, or 0 for none")
        for what, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias keys", list(params.logit_bias or ()))):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, "
                                 f"{self.vocab_size})")
        so = params.structured_outputs
        return self.grammars.matcher(so) if so is not None else None

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A conversation rendered with the model's chat template (ValueError when it has
        none)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (no tokenizer.json), so chat is not "
                             "available; give token ids as the prompt")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        if params.n != 1:
            raise ValueError(f"n={params.n}: the engine runs one sample per request; add the "
                             "requests of SamplingParams.samples() (LLM.generate does)")
        grammar = self.check_params(params)
        ids = self.prompt_ids(prompt)
        text = prompt if isinstance(prompt, str) else None
        n = next(self._ids)
        rid = request_id if request_id is not None else str(n)
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        gen = torch.Generator(device=self.device)
        # Unseeded requests still get a reproducible stream: engine seed + arrival number.
        gen.manual_seed(params.seed if params.seed is not None
                        else (self.config.model_config.seed * 1_000_003 + n) % 2**63)
        req = Request(
            request_id=rid, prompt=text, prompt_token_ids=ids, params=params, generator=gen,
            max_total_tokens=self.max_model_len,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None,
            grammar=grammar)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            req.finish_reason = "abort"
            self._finish(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that made progress."""
        with self.executor.scope():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        # adaptive K times decode steps only (no prompt tokens), by the K their drafts had
        timed = self.adaptive_k is not None and all(
            b.num_new_tokens == 1 + b.num_spec_tokens for b in batch)
        step_k = max(b.request.spec_budget for b in batch) if timed else 0
        out = self.runner.execute(batch)
        self._prompt_logprobs(batch, out)
        sampled = [(i, b) for i, b in enumerate(batch) if b.num_sample_rows]
        if sampled:
            vreqs = [VerifyRequest(b.request.spec_token_ids[:b.num_spec_tokens],
                                   b.request.spec_token_probs, b.request.params,
                                   b.request.generator,
                                   b.request.spec_parents if b.num_spec_tokens else None,
                                   len(b.request.output_token_ids))
                     for _, b in sampled]
            raw = self._process_rows(sampled, vreqs, out.logits)
            errors: dict[int, Exception] = {}
            tokens = verify(out.logits, vreqs, self.verify_method, self.synthetic_rates,
                            errors).tolist()
            row = 0
            for n, ((i, b), v, toks) in enumerate(zip(sampled, vreqs, tokens)):
                logits = raw.get(n, out.logits[row:row + b.num_sample_rows])
                row += b.num_sample_rows
                if n in errors:
                    self._fail(b.request, "verification", errors[n])
                    continue
                try:
                    toks = [t for t in toks if t != PLACEHOLDER_TOKEN_ID]
                    if v.parents is not None:
                        logits = self._settle_tree(i, b, v, toks, out, logits)
                    self._update(b, toks, logits)
                except Exception as e:
                    self._fail(b.request, "its update (stop checks, detokenizing, logprobs)", e)
        for b in batch:
            if not b.num_sample_rows:                      # partial prefill
                b.request.num_computed_tokens += b.num_new_tokens
        for b in batch:
            if b.request.is_finished:
                self.requests.pop(b.request.request_id, None)
                self._finish(b.request)
        if self.proposer is not None:
            t1 = time.perf_counter()
            num_decoding, k = self._propose(batch, out)
            if timed:
                self.adaptive_k.observe("verify", len(batch), step_k, t1 - t0)
                if num_decoding:
                    self.adaptive_k.observe("propose", num_decoding, k,
                                            time.perf_counter() - t1)
        if self.prefix_cache is not None:     # prompts just computed, drafters' state too
            for b in batch:
                r = b.request
                if (not r.prompt_stored and not r.is_finished
                        and r.num_computed_tokens >= r.num_prompt_tokens):
                    r.prompt_stored = True
                    self._store_prefix(r)
        self._maybe_log()
        # after drafting, which may fail a request too
        return [self._output(b.request) for b in batch
                if b.num_sample_rows or b.request.is_finished]

    @torch.inference_mode()
    def _prompt_logprobs(self, batch: list[ScheduledRequest], out: RunnerOutput) -> None:
        """Log-probabilities of the prompt tokens this step's rows predict (the row of position
        p gives token p + 1's), for the requests that asked."""
        for i, b in enumerate(batch):
            r = b.request
            P = r.num_prompt_tokens
            if r.prompt_logprobs is None or len(r.prompt_logprobs) >= P:
                continue
            start = out.starts[i]
            end = min(start + b.num_new_tokens - b.num_spec_tokens, P - 1)   # positions < end
            if end <= start:
                continue
            rows = out.hidden[out.cu_num_tokens[i]:out.cu_num_tokens[i] + end - start]
            r.prompt_logprobs.extend(token_logprobs(
                self.model.compute_logits(rows), r.prompt_token_ids[start + 1:end + 1],
                r.params.prompt_logprobs))

    @torch.inference_mode()
    def _process_rows(self, sampled: list[tuple[int, ScheduledRequest]],
                      vreqs: list[VerifyRequest], logits: torch.Tensor
                      ) -> dict[int, torch.Tensor]:
        """logit_bias, penalties and grammar masks on each request's verify rows, in place;
        returns the rows as they were of the processed requests that want logprobs (which are
        the model's, as vLLM returns them), by their place in `sampled`."""
        row, raw = 0, {}
        for n, ((_, b), v) in enumerate(zip(sampled, vreqs)):
            r, rows = b.request, logits[row:row + b.num_sample_rows]
            penalized = needs_processing(r.params)
            if r.logprobs is not None and (penalized or r.grammar is not None):
                raw[n] = rows.clone()
            if penalized:
                apply_penalties(rows, r.params, r.prompt_token_ids, r.output_token_ids,
                                draft_paths(v.draft_token_ids, v.parents))
            if r.grammar is not None:
                self.grammars.mask_rows(r.grammar, rows, v.draft_token_ids, v.parents)
            row += b.num_sample_rows
        return raw

    @torch.inference_mode()
    def _settle_tree(self, i: int, b: ScheduledRequest, v: VerifyRequest, tokens: list[int],
                     out: RunnerOutput, logits: torch.Tensor) -> torch.Tensor:
        """Move the accepted branch of request i's draft tree to where a chain would have put it:
        its KV to the positions after the last verified token, its hidden-state rows (which
        the proposer reads) likewise. Returns its logits rows in emitted-token order."""
        path = accepted_path(v.parents, v.draft_token_ids, tokens)
        self.spec_stats.observe_tree_path(path)
        if path == list(range(len(path))):          # the first-child chain: already in place
            return logits
        n_known = b.num_new_tokens - b.num_spec_tokens
        src = [n_known + c for c in path]
        dst = list(range(n_known, n_known + len(path)))
        start, row0 = out.starts[i], out.cu_num_tokens[i]
        self.cache.move(b.request.slot, [start + j for j in src], [start + j for j in dst])
        for t in (out.hidden, out.aux_hidden):
            if t is not None:
                t[[row0 + j for j in dst]] = t[[row0 + j for j in src]]
        return logits[[0] + [1 + c for c in path]]

    def _update(self, b: ScheduledRequest, tokens: list[int], logits: torch.Tensor) -> None:
        req = b.request
        k = b.num_spec_tokens
        num_accepted = len(tokens) - 1
        # KV was written for [last, d1..dk]; keep it for [last, d1..d_accepted] only.
        req.num_computed_tokens += b.num_new_tokens - (k - num_accepted)
        self.spec_stats.observe(k, num_accepted)
        if self.adaptive_k is not None and k:
            self.adaptive_k.observe_acceptance(k, num_accepted)
        req.spec_metrics.observe(k, num_accepted)
        req.spec_token_ids = []
        req.spec_token_probs = None
        req.spec_parents = None
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.grammar is not None:
            tokens = self._consume_grammar(req, tokens)
        kept = self._append_tokens(req, tokens)
        if req.grammar is not None and req.grammar.is_stopped() and not req.is_finished:
            self._stop(req, "stop", None)          # the grammar's output is complete
        if req.logprobs is not None and kept:
            req.logprobs.extend(token_logprobs(logits[:kept], tokens[:kept], req.params.logprobs))

    @staticmethod
    def _consume_grammar(req: Request, tokens: list[int]) -> list[int]:
        """Advance the request's grammar over its accepted tokens; the tokens up to where the
        grammar's output is complete (after that only EOS could follow: the output ends
        there, as it does without drafts)."""
        for j, t in enumerate(tokens):
            if not req.grammar.consume_token(t):
                raise ValueError(f"the grammar refused a token it allowed: "
                                 f"{req.grammar.get_error()}")
            if req.grammar.is_stopped():
                return tokens[:j + 1]
        return tokens

    def _append_tokens(self, req: Request, tokens: list[int]) -> int:
        """Append emitted tokens one by one, stopping exactly where a stop condition hits.
        Returns how many were kept."""
        p = req.params
        for i, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            req.all_token_ids.append(tok)
            if tok in req.eos_token_ids:
                self._stop(req, "stop", None)
                return i + 1
            if req.detokenizer is not None and self._append_text(req, req.detokenizer.add([tok])):
                return i + 1
            if tok in p.stop_token_ids:
                self._stop(req, "stop", tok)
                return i + 1
            if req.max_new_tokens <= 0:
                self._stop(req, "length", None)
                return i + 1
        return len(tokens)

    def _append_text(self, req: Request, delta: str) -> bool:
        """Append detokenized text; True when a stop string ended the request (text cut there)."""
        if not delta or not req.params.stop_strings:
            req.text += delta
            return False
        text = req.text + delta
        start = len(req.text)
        for s in req.params.stop_strings:
            idx = text.find(s, max(0, start - len(s) + 1))
            if idx != -1:
                end = idx + len(s) if req.params.include_stop_str_in_output else idx
                req.text = text[:end]
                self._stop(req, "stop", s)
                return True
        req.text = text
        return False

    def _stop(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        if req.detokenizer is not None and not isinstance(stop_reason, str):
            req.text += req.detokenizer.flush()
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.status = RequestStatus.FINISHED
        req.finish_time = time.monotonic()

    def _finish(self, req: Request) -> None:
        if self.prefix_cache is not None and req.slot is not None and req.finish_reason != "error":
            try:
                self._store_prefix(req)         # the history a next turn resends
            except Exception:
                logger.exception("storing the prefix of request %s failed", req.request_id)
        self.scheduler.finish(req)
        if self.proposer is not None:
            try:
                self.proposer.finish(req)
            except Exception:       # the request is gone anyway; the proposer's state of it too
                logger.exception("proposer.finish failed for request %s", req.request_id)

    def _fail(self, req: Request, stage: str, error: Exception, now: bool = False) -> None:
        """Abort one request whose own work raised; the rest of the batch carries on
        (finish_reason "error"). It leaves the engine with the step's other finished requests,
        or at once with `now` (drafting comes after those have left)."""
        logger.error("request %s failed in %s; aborting it alone", req.request_id, stage,
                     exc_info=error)
        self._stop(req, "error", None)
        req.error = f"the request failed in {stage}: {type(error).__name__}: {error}"
        if now:
            self.requests.pop(req.request_id, None)
            self._finish(req)

    def _propose(self, batch: list[ScheduledRequest], out: RunnerOutput) -> tuple[int, int]:
        """Drafts for the requests that decode next step; returns (how many requests decode
        next step, the K they were given)."""
        num_running = len(self.scheduler.running)
        k = self.spec.k_for_batch_size(num_running)
        if self.adaptive_k is not None:
            k = self.adaptive_k.choose(num_running, k)
        reqs, budgets = [], []
        num_decoding = 0
        for b in batch:
            r = b.request
            r.spec_budget = 0
            if r.is_finished or r.num_computed_tokens != r.num_tokens - 1:
                continue
            num_decoding += 1
            own = r.params.num_speculative_tokens          # the request's own K, if any
            cap = k if own is None else min(k, own)
            room = min(cap, r.max_new_tokens - 1)
            if self.draft_max_len is not None:      # drafts stay inside the drafter's context
                room = min(room, self.draft_max_len - r.num_tokens + 1)
            if room > 0:
                r.spec_budget = cap
                reqs.append(r)
                budgets.append(room)
        try:
            t = time.perf_counter()
            proposals = self.proposer.propose(
                ProposeBatch(reqs, budgets, [b.request for b in batch], out))
            if reqs:
                self.spec_stats.observe_drafting(time.perf_counter() - t)
        except Exception as e:
            # A batched proposer call cannot be pinned on one request, and its per-request
            # state (KV, hidden-state rows) is now unknown: the step's requests fail, the
            # engine goes on for the others.
            for b in batch:
                if not b.request.is_finished:
                    self._fail(b.request, "drafting (proposer.propose)", e, now=True)
            return num_decoding, k
        for r, prop, room in zip(reqs, proposals, budgets):
            problem = self._check_proposal(prop, room)
            if problem is not None:
                self._fail(r, "drafting", ValueError(problem), now=True)
                continue
            r.spec_token_ids = list(prop.token_ids)
            r.spec_token_probs = prop.probs
            r.spec_parents = prop.parents
            if r.grammar is not None and prop.parents is None:   # a chain ends where it must
                n = self.grammars.valid_drafts(r.grammar, r.spec_token_ids)
                del r.spec_token_ids[n:]
                if prop.probs is not None:
                    r.spec_token_probs = prop.probs[:n]
        return num_decoding, k

    def _check_proposal(self, prop: Proposal, room: int) -> str | None:
        """What is wrong with a proposer's drafts (they would index the target's embedding),
        or None."""
        toks = prop.token_ids
        if len(toks) > room:
            return f"the proposer returned {len(toks)} drafts where at most {room} were allowed"
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in toks):
            return f"the proposer returned draft ids outside [0, {self.vocab_size}): {toks}"
        if prop.parents is not None and len(prop.parents) != len(toks):
            return "the proposer's tree has a parent count unlike its draft count"
        return None

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval_s
        now = time.monotonic()
        if interval > 0 and self.spec is not None and now - self._last_log >= interval:
            logger.info(self.spec_stats.log_line(now - self._start))
            self._last_log = now

    def _output(self, req: Request) -> RequestOutput:
        comp = CompletionOutput(0, req.text, list(req.output_token_ids), req.finish_reason,
                                req.stop_reason, list(req.logprobs) if req.logprobs is not None else None)
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        if req.finish_time is not None:
            metrics["finish_time"] = req.finish_time
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp],
                             req.is_finished, req.spec_metrics if self.spec else None, metrics,
                             req.error, req.num_cached_tokens, req.prompt_logprobs)

    def reset_proposer(self) -> None:
        """Forget what the proposer kept across requests (a benchmark repeating its prompts)."""
        if self.proposer is not None:
            self.proposer.reset()

    def get_stats(self) -> dict:
        m = self.spec_stats.as_dict()
        if self.proposer is not None:
            m |= self.proposer.stats()
        if self.prefix_cache is not None:
            m |= self.prefix_cache.stats()
        if self.spec is not None and self.spec.auto_choice:
            m["auto_choice"] = self.spec.auto_choice
        if self.adaptive_k is not None:
            m["adaptive_k_choices"] = dict(sorted(self.adaptive_k.chosen.items()))  # K -> steps
        return m


