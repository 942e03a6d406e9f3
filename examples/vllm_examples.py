"""vLLM's speculative-decoding examples, with `vllm` changed to `specserve` and the models to the
bundled zoo; each one runs and prints what it got. From the repository root:

    python examples/vllm_examples.py

1. offline EAGLE (`LLM(..., speculative_config={"model": ..., "draft_tensor_parallel_size": 1})`)
2. ngram from a YAML file passed inline: `--speculative-config "$(cat ngram.yaml)"`
3. `specserve serve` with draft_model, suffix, mtp and medusa, each asked one completion
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import Request, urlopen

from specserve import LLM, SamplingParams

ZOO = "models"
SPECSERVE = [sys.executable, "-m", "specserve.cli"]      # the `specserve` command
SERVE = {
    "draft_model": ("models/code-target", {"model": f"{ZOO}/code-draft",
                                           "num_speculative_tokens": 4}),
    "suffix": ("models/code-target", {"method": "suffix", "num_speculative_tokens": 4}),
    "mtp": (f"{ZOO}/code-target-mtp", {"method": "mtp", "num_speculative_tokens": 1}),
    "medusa": ("models/code-target", {"model": f"{ZOO}/code-target-medusa",
                                      "num_speculative_tokens": 4}),
}


def offline_eagle() -> None:
    llm = LLM(model=f"{ZOO}/code-target", device="cpu", speculative_config={
        "model": f"{ZOO}/code-target-eagle", "draft_tensor_parallel_size": 1,
        "num_speculative_tokens": 2})
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=32),
                       use_tqdm=False)[0]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    print(f"offline eagle: {len(out.outputs[0].token_ids)} tokens, "
          f"{metrics['vllm:spec_decode_num_drafts']} drafts")


def ngram_from_yaml() -> None:
    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "ngram.yaml"
        spec.write_text("method: ngram\nnum_speculative_tokens: 4\nprompt_lookup_max: 4\n"
                        "prompt_lookup_min: 2\n")
        out = subprocess.run([*SPECSERVE, "generate", f"{ZOO}/code-target", "--device", "cpu",
                              "--prompt", "x = [1, 2, 3, 1, 2, 3, 1, 2,", "--max-tokens", "16",
                              "--speculative-config", spec.read_text()],
                             capture_output=True, text=True, check=True)
    print("ngram from yaml:", out.stderr.strip().splitlines()[-1])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(name: str) -> None:
    model, spec = SERVE[name]
    port = _port()
    proc = subprocess.Popen([*SPECSERVE, "serve", model, "--device", "cpu", "--port", str(port),
                             "--speculative-config", json.dumps(spec)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"serve {name} did not start: {proc.stderr.read()}")
                time.sleep(0.2)
        body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0,
                           "include_spec_metrics": True}).encode()
        req = Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(urlopen(req, timeout=60).read())
        print(f"serve {name}: {answer['usage']['completion_tokens']} tokens, "
              f"{answer['spec_metrics'][0]['num_drafts']} drafts")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"serve {name} exited with {proc.returncode}")


def main() -> None:
    offline_eagle()
    ngram_from_yaml()
    for name in SERVE:
        serve(name)
    print("all examples ran")


if __name__ == "__main__":
    sys.exit(main())
