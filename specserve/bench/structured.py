"""`specserve bench structured`: decoding under a JSON schema, with and without speculation.

Each prompt asks the chat model for a JSON object and gives it the schema as
`structured_outputs`; every configuration answers the same prompts (batch 1, greedy) in
interleaved rounds. Reported per configuration: decode tokens/s after the first token (median
of rounds), its ratio to no-spec under the same schema, the share of outputs that parse and
follow the schema, whether the tokens equal no-spec's, and the mean acceptance length.
"""

from __future__ import annotations

import argparse
import json
import statistics

from specserve.bench import report
from specserve.bench.probes import machine
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams, StructuredOutputsParams

_STR = {"type": "string", "maxLength": 60}
# (what to ask for, its schema): written for this benchmark, not taken from any public set
TASKS = [
    ("a book you would recommend: title, author, year and three keywords",
     {"title": _STR, "author": _STR, "year": {"type": "integer"},
      "keywords": {"type": "array", "items": _STR, "maxItems": 3}}),
    ("a city: its name, country, population and whether it is a capital",
     {"name": _STR, "country": _STR, "population": {"type": "integer"},
      "capital": {"type": "boolean"}}),
    ("a recipe: its name, minutes to cook, and up to five ingredients",
     {"name": _STR, "minutes": {"type": "integer"},
      "ingredients": {"type": "array", "items": _STR, "maxItems": 5}}),
    ("a person in a story: name, age, job and mood (happy, sad or calm)",
     {"name": _STR, "age": {"type": "integer"}, "job": _STR,
      "mood": {"enum": ["happy", "sad", "calm"]}}),
    ("a planet of the solar system: name, moons, and whether it has rings",
     {"name": _STR, "moons": {"type": "integer"}, "rings": {"type": "boolean"}}),
    ("a bug report: title, severity (low, medium or high), and steps to reproduce",
     {"title": _STR, "severity": {"enum": ["low", "medium", "high"]},
      "steps": {"type": "array", "items": _STR, "maxItems": 4}}),
    ("a movie: title, year, director and a one-sentence summary",
     {"title": _STR, "year": {"type": "integer"}, "director": _STR, "summary": _STR}),
    ("a weather report: city, temperature in Celsius, and conditions",
     {"city": _STR, "temperature": {"type": "number"}, "conditions": _STR}),
]


def schema_of(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def follows(text: str, props: dict) -> bool:
    """The output parses and has exactly the schema's keys with values of their types."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
             "array": list}
    return isinstance(obj, dict) and set(obj) == set(props) and all(
        obj[k] in p["enum"] if "enum" in p else isinstance(obj[k], types[p["type"]])
        for k, p in props.items())


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="specserve bench structured", description=__doc__)
    p.add_argument("mode", choices=["structured"])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--configs", default='{"ngram": {"method": "ngram", "num_speculative_tokens": '
                   '3}, "eagle3": {"model": "smollm2-135m-instruct-eagle3", '
                   '"num_speculative_tokens": 2}, "auto": {"method": "auto"}}',
                   help="JSON: name -> speculative_config of each configuration beside no-spec")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--title", default="Structured output (JSON schema) with speculation")
    report.add_output_args(p)
    a = p.parse_args(argv)
    configs = {"no-spec": None} | json.loads(a.configs)
    # one request at a time: one KV slot (16 slots of SmolLM2's 8,192 positions are 6 GB)
    engines = {name: LLM(a.target, speculative_config=spec, dtype=a.dtype, device="cpu",
                         freeze_gc=True, max_num_seqs=1) for name, spec in configs.items()}
    prompts = [f"Describe {what} as a JSON object." for what, _ in TASKS]
    params = [SamplingParams(temperature=0, max_tokens=a.max_tokens, structured_outputs=(
        StructuredOutputsParams(json=schema_of(props)))) for _, props in TASKS]
    speeds: dict[str, list[float]] = {n: [] for n in configs}
    outputs: dict[str, list] = {}
    for r in range(a.rounds):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            outs = [llm.chat([[{"role": "user", "content": q}]], sp, use_tqdm=False)[0]
                    for q, sp in zip(prompts, params)]
            tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
            seconds = sum(o.metrics["finish_time"] - o.metrics["first_token_time"] for o in outs)
            speeds[name].append(tokens / seconds)
            outputs[name] = outs
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    base = statistics.median(speeds["no-spec"])
    ref = [o.outputs[0].token_ids for o in outputs["no-spec"]]
    rows = []
    for name, llm in engines.items():
        outs = outputs[name]
        tps = statistics.median(speeds[name])
        stats = llm.get_stats()
        rows.append({
            "config": name, "speculative_config": configs[name], "tokens_per_s": tps,
            "rounds": speeds[name], "speedup": tps / base,
            "valid": sum(follows(o.outputs[0].text, props)
                         for o, (_, props) in zip(outs, TASKS)) / len(outs),
            "equal_to_no_spec": [o.outputs[0].token_ids for o in outs] == ref,
            "mean_acceptance_length": stats["mean_acceptance_length"] if configs[name] else None,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
        print(f"{name}: {tps:.1f} tokens/s ({tps / base:.2f}x), valid {rows[-1]['valid']:.0%}, "
              f"equal {rows[-1]['equal_to_no_spec']}", flush=True)
    data = {"benchmark": "structured", "title": a.title,
            "command": "specserve bench " + " ".join(argv), "machine": machine(),
            "settings": {"target": a.target, "dtype": a.dtype, "max_tokens": a.max_tokens,
                         "rounds": a.rounds, "tasks": [w for w, _ in TASKS]},
            "rows": rows, "example": outputs["no-spec"][0].outputs[0].text}
    print(report.save(data, a.out, a.publish))
