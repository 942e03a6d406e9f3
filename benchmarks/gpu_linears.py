"""The products of one Llama-3.1-8B decode step alone on a GPU (bfloat16, M = 1, 5 and 16
rows): time and weight bytes per second of each layer linear (fused q/k/v, o, fused gate/up,
down) and the lm_head, to set beside `specserve bench gpu`'s whole-step time. Each product is
repeated on the same weights, so the ones that fit the L2 cache (the 32 MB o projection on an
H200's 60 MB) read faster than in a step. Usage: python benchmarks/gpu_linears.py"""

import time

import torch
import torch.nn.functional as F

H, Q, KV, INTER, VOCAB = 4096, 4096, 1024, 14336, 128256
SHAPES = {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * INTER, H), "down": (H, INTER),
          "lm_head": (VOCAB, H)}


def ms(fn, n: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    dev = torch.device("cuda")
    for name, (out, inp) in SHAPES.items():
        w = torch.randn(out, inp, device=dev, dtype=torch.bfloat16)
        for m in (1, 5, 16):
            x = torch.randn(m, inp, device=dev, dtype=torch.bfloat16)
            t = ms(lambda x=x, w=w: F.linear(x, w))
            print(f"{name} {out}x{inp} M={m}: {t:.4f} ms, {w.numel() * 2 / t / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
