"""The compiled few-row CPU forward (`kernel.c`) for Llama-family models held in float32
(a bfloat16 model is held in float32 with its matrix products taking bfloat16 inputs).

Eager PyTorch spends a batch-1 decode step of a small model mostly outside the weights: some
twenty kernel launches per layer, and one-row matrix products that read the weights at well
under the memory bandwidth. `CpuLayer` runs a decoder layer's step of
up to `max_rows(lib)` rows (causal runs, or draft-tree nodes under the step's mask) in one C
call, `LlamaForward` a whole model's step, and `linear_rows` one matrix (lm_head, heads);
`HeadChain` and `LlamaChain` run all the greedy passes of a drafter's step (an EAGLE, EAGLE-3
or MTP head, a draft model) in one call. Each output element is computed the same way whatever
else is in the step, so a row's result does not depend on batch composition (a one-token decode
and a five-token verify agree bit for bit).

The C file is compiled on first use with the machine's C compiler (`$CC`, default `cc`; extra
`$CFLAGS` go last, so `CFLAGS=-march=haswell` builds for AVX2 on an AVX-512 machine) into
`~/.cache/specserve/kernels` (or `$XDG_CACHE_HOME`); where that fails, a warning says so and
the PyTorch path runs. Prompt chunks longer than `max_rows(lib)` (512 with AVX-512, 48 with
AVX2) run layer by layer in PyTorch, their matrix products still in `linear_rows`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("kernel.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
GROUP = 4                # blocks of a packed weight kept input by input (GROUP in C)
QB = 32                  # int8: inputs per activation scale (QB in C)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class _Shape(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate", "attn_in", "max_len", "mode",
                                    "rot_stride", "kv_bf16")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _args(name: str, fields: list[tuple[str, object]]) -> type[ctypes.Structure]:
    """A ctypes mirror of one of kernel.c's argument structs (its size is checked at load)."""
    return type(name, (ctypes.Structure,), {"_fields_": fields})


_F, _C = ctypes.c_float, ctypes.c_int
_LayerArgs = _args("LayerArgs", [
    ("s", ctypes.POINTER(_Shape)), ("T", _I64), ("x", _P), ("attn_in", _P), ("slots", _P),
    ("positions", _P), ("w", _P), ("k_cache", _P), ("v_cache", _P), ("cos", _P), ("sin", _P),
    ("mask", _P), ("mask_stride", _I64), ("half", _I64), ("out", _P), ("nthreads", _C)])
_LlamaChainArgs = _args("LlamaChainArgs", [
    ("s", ctypes.POINTER(_Shape)), ("L", _I64), ("T", _I64), ("in_tok", _P), ("in_slot", _P),
    ("in_pos", _P), ("last", _P), ("B", _I64), ("n", _I64), ("slots", _P),
    ("pos0", _P), ("budget", _P), ("threshold", _F), ("embed", _P), ("final_norm", _P),
    ("lm_head", _P), ("lm_mode", _C), ("vocab", _I64), ("cos_sin", _P), ("w", _P),
    ("k_cache", _P), ("v_cache", _P), ("tokens", _P), ("nthreads", _C)])
_LlamaForwardArgs = _args("LlamaForwardArgs", [
    ("s", ctypes.POINTER(_Shape)), ("L", _I64), ("T", _I64), ("ids", _P), ("slots", _P),
    ("positions", _P), ("rope", _P), ("embed", _P), ("final_norm", _P), ("eps", _F),
    ("cos_sin", _P), ("w", _P), ("k_cache", _P), ("v_cache", _P), ("mask", _P),
    ("mask_stride", _I64), ("n_aux", _I64), ("aux_layers", _P), ("aux", _P), ("hidden", _P),
    ("ar", _P), ("nthreads", _C)])
_WriteKVArgs = _args("WriteKVArgs", [
    ("kv", _P), ("T", _I64), ("L", _I64), ("NKV", _I64), ("D", _I64), ("max_len", _I64),
    ("k_norm", _P), ("eps", _F), ("cos_sin", _P), ("slots", _P), ("positions", _P),
    ("k_cache", _P), ("v_cache", _P), ("kv_bf16", _C)])
_AllReduceArgs = _args("AllReduceArgs", [
    ("x", _P), ("n", _I64), ("shm", _P), ("cap", _I64), ("rank", _I64), ("size", _I64),
    ("seq", _I64), ("timeout_s", ctypes.c_double), ("peers", _P), ("npeers", _I64),
    ("parent", _I64)])
_ChannelArgs = _args("ChannelArgs", [
    ("shm", _P), ("seen", ctypes.c_uint32), ("timeout_s", ctypes.c_double)])


_ScreenArgs = _args("ScreenArgs", [
    ("x", _P), ("T", _I64), ("inp", _I64), ("out", _I64), ("screen", _P), ("absq", _P),
    ("scale", _P), ("wp", _P), ("mode", _C), ("rows", _P), ("max_candidates", _I64), ("y", _P),
    ("ncand", _P), ("nthreads", _C)])

class _HeadChainArgs(ctypes.Structure):
    """kernel.c's HeadChainArgs, field by field (its size is checked at load)."""

    _fields_ = [("s", ctypes.POINTER(_Shape)), ("T", _I64),
                ("in_tok", _P), ("in_slot", _P), ("in_pos", _P), ("last", _P), ("in_h", _P),
                ("B", _I64), ("n", _I64), ("state", _P), ("slots", _P), ("pos0", _P),
                ("budget", _P), ("threshold", ctypes.c_float), ("embed", _P), ("e_norm", _P),
                ("h_norm", _P), ("fc", _P), ("fc_mode", ctypes.c_int), ("fc_bias", _P),
                ("final_norm", _P), ("lm_head", _P), ("lm_mode", ctypes.c_int),
                ("vocab", _I64), ("d2t", _P), ("cos_sin", _P), ("w", _P), ("k_cache", _P),
                ("v_cache", _P), ("tokens", _P), ("nthreads", ctypes.c_int)]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specserve" / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: a library built for one CPU may not run on another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))),
                "")


def cpu_flags() -> set[str]:
    """The instruction-set flags the CPU reports (/proc/cpuinfo; empty where none is read)."""
    return set(_cpu_id().split())


def _build(cc: str, flags: tuple[str, ...], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run([cc, *flags, "-o", str(built), str(SOURCE), "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(built, path)        # atomic: a concurrent build cannot half-write


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per source, compiler and CPU; None when it cannot be.
    A cached library that does not load (truncated, built by another toolchain) is rebuilt once."""
    cc = os.environ.get("CC", "cc")
    flags = (*FLAGS, *os.environ.get("CFLAGS", "").split())   # later flags win: -march=...
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *flags, _cpu_id())).encode())
    path = _cache_dir() / f"cpu_kernel-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(cc, flags, path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            path.unlink(missing_ok=True)
            _build(cc, flags, path)
            lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"specserve: the CPU decode kernel could not be built with {cc!r} "
                      f"({detail}); running the slower PyTorch path. Install a C compiler with "
                      "OpenMP (gcc) or set CC to one.", RuntimeWarning, stacklevel=2)
        return None
    lib.specserve_linear.argtypes = [_P, _I64, _P, ctypes.c_int, _P, _I64, _I64, _P, _I64,
                                     ctypes.c_int, ctypes.c_int]
    lib.specserve_linear.restype = ctypes.c_int
    lib.specserve_rms_norm.argtypes = [_P, _P, ctypes.c_float, _I64, _I64, _P]
    lib.specserve_rms_norm.restype = None
    lib.specserve_stream.argtypes = [_P, _P, _I64, ctypes.c_int]
    lib.specserve_stream.restype = _I64
    for name, args in (("layer", _LayerArgs), ("head_chain", _HeadChainArgs),
                       ("llama_chain", _LlamaChainArgs), ("llama_forward", _LlamaForwardArgs),
                       ("write_kv", _WriteKVArgs), ("all_reduce", _AllReduceArgs),
                       ("channel", _ChannelArgs), ("screen", _ScreenArgs)):
        size = getattr(lib, f"specserve_{name}_args_size")
        for fn in [getattr(lib, f"specserve_{name}{op}", None) for op in ("", "_post", "_wait")]:
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.POINTER(args)], ctypes.c_int
        size.argtypes, size.restype = [], ctypes.c_size_t
        if size() != ctypes.sizeof(args):
            raise RuntimeError(f"specserve: kernel.c's argument struct of specserve_{name} and "
                               "binding.py's differ; update them together")
    for fn in (lib.specserve_block, lib.specserve_max_rows, lib.specserve_amx):
        fn.argtypes, fn.restype = [], ctypes.c_int
    return lib


def cpu_features(lib: ctypes.CDLL) -> str:
    """The instruction set the library was built for, in words."""
    flags = cpu_flags()
    width = "AVX-512" if lib.specserve_block() == 16 else "AVX2" if lib.specserve_block() == 8 \
        else f"{lib.specserve_block()}-wide vectors"
    return (width + (" with AVX512-BF16" if "avx512_bf16" in flags else "")
            + (" and AMX tiles" if lib.specserve_amx() else ""))


@functools.cache
def max_rows(lib: ctypes.CDLL) -> int:
    """The most rows a step (decode, verify, a prompt chunk, a batch of them) may have to take
    the kernel: where it beats PyTorch's blocked matrix multiply on its instruction set."""
    return lib.specserve_max_rows()


def quantize_int8(weight: torch.Tensor, absmax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of weight [out, in], one scale per output column: q [out, in] int8 in
    [-127, 127] and scale [out] float32 with weight ~= q * scale[:, None] (a zero column gets
    scale 0). `absmax` [out]: each column's largest magnitude when `weight` holds only some of
    its inputs (a tensor-parallel shard: every rank then gets the whole column's int8 values)."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) if absmax is None else absmax.float()) / 127         # [out]
    q = (w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale


# llama.cpp's block types the kernel multiplies as they are (Q4: 4-bit values, Q8: 8-bit)
BLOCK_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0"}


def quantize_blocks(weight: torch.Tensor, kind: str
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [out, in] -> llama.cpp's `kind` blocks of QB inputs, quantized by the gguf
    package (llama.cpp's reference rounding: a GGUF's blocks come back byte for byte from
    their dequantized values), split into values [out, nblk, 16 or 32] uint8 (Q4: a block's
    16 bytes as the file has them; Q8: the int8 values + 128) and the float16 d and m
    [out, nblk] of weight = d u + m."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    w = weight.detach().float()
    if w.shape[1] % QB:
        w = torch.cat([w, w.new_zeros(len(w), -w.shape[1] % QB)], 1)
    raw = quantize(w.numpy(), GGMLQuantizationType[BLOCK_TYPES[kind]])
    raw = raw.reshape(len(w), w.shape[1] // QB, -1)                    # [out, nblk, bytes]
    d = raw[..., :2].copy().view(np.float16)[..., 0]
    if kind == "q4_1":
        m, values = raw[..., 2:4].copy().view(np.float16)[..., 0], raw[..., 4:]
    elif kind == "q4_0":
        m, values = -8 * d, raw[..., 2:]                          # exact: a power of two
    else:
        m, values = np.zeros_like(d), (raw[..., 2:].view(np.int8).astype(np.int16)
                                       + 128).astype(np.uint8)
    return values, d, m


def pack_weight(weight: torch.Tensor, block: int, pairs: bool = False,
                quantization: str | None = None, absmax: torch.Tensor | None = None
                ) -> torch.Tensor:
    """weight [out, in] (float32 or bfloat16) -> the kernel's layout
    [ceil(out / (GROUP block)), in, GROUP, block]: groups of GROUP blocks of `block` output
    columns (the kernel's vector width, `lib.specserve_block()`), input by input, so that the
    weights a tile multiplies stream as one run; the padding columns and inputs are zero and
    never used.

    Weights that bfloat16 holds exactly (a checkpoint stored in bfloat16, like the bundled
    zoo) are packed in bfloat16, inputs 2i and 2i + 1 side by side: the kernel streams half the
    bytes and widens a pair per 32-bit lane. The products and sums are those of float32 weights.
    Layout [.., ceil(in / 2), GROUP, 2 block]; with `pairs` (the inputs rounded to bfloat16
    too: bfloat16 models; the weight must hold bfloat16 values) the same bytes as
    [.., ceil(in / 2), GROUP, block, 2]. `quantization="int8"`: `quantize_int8`'s values +
    128 (unsigned bytes, what the dot product instruction takes; the inputs padded with zeros
    to a multiple of QB), each group [in_q / 4, GROUP, block, 4] (four consecutive inputs of a column side
    by side) followed by its GROUP block float32 scales, as int8 [groups, (in_q + 4) GROUP
    block] (`absmax`: see `quantize_int8`). "q4_0", "q4_1", "q8_0":
    `quantize_blocks`'s, each group block by block as [units, GROUP block, 4] value bytes (a
    unit: four bytes of each column; Q4's hold inputs 4p.. in their low nibbles and 16 + 4p..
    in their high ones), then the GROUP block d and (Q4) m in float16, as uint8 [groups, nblk,
    20 (Q4) or 34 (Q8), GROUP block]. `weight_mode` tells the six apart."""
    out, inp = weight.shape
    w = weight.detach()
    if out % (GROUP * block):
        w = torch.cat([w, w.new_zeros(-out % (GROUP * block), inp)])
    if quantization in BLOCK_TYPES:
        values, d, m = quantize_blocks(w, quantization)
        cols, nblk = GROUP * block, d.shape[1]
        units = values.shape[2] // 4
        v = values.reshape(-1, cols, nblk, units, 4).transpose(0, 2, 3, 1, 4)
        # Q8_0's m is always 0: its blocks carry d alone (2 bytes a column fewer to stream)
        scales = [a.reshape(-1, cols, nblk).transpose(0, 2, 1).copy().view(np.uint8)
                  for a in ((d,) if quantization == "q8_0" else (d, m))]  # [groups, nblk, 2 cols]
        packed = np.concatenate([v.reshape(len(v), nblk, -1)] + scales, 2)
        return torch.from_numpy(packed.reshape(len(v), nblk, -1, cols))
    if quantization == "int8":
        if absmax is not None:
            absmax = torch.cat([absmax, absmax.new_zeros(len(w) - len(absmax))])
        q, scale = quantize_int8(w, absmax)
        u = (q.to(torch.int32) + 128).to(torch.uint8)
        u = torch.cat([u, u.new_full((len(u), -inp % QB), 128)], 1).view(torch.int8)
        u = u.view(-1, GROUP, block, u.shape[1] // 4, 4).permute(0, 3, 1, 2, 4)
        u = u.reshape(len(w) // (GROUP * block), -1)
        return torch.cat([u, scale.view(len(u), -1).contiguous().view(torch.int8)], 1)
    as_bf16 = w.to(torch.bfloat16)
    if w.dtype != torch.bfloat16 and not torch.equal(as_bf16.float(), w):
        if pairs:
            raise ValueError("pack_weight: pairs=True needs weights that bfloat16 holds exactly")
        return w.float().view(-1, GROUP, block, inp).permute(0, 3, 1, 2).contiguous()
    w = torch.cat([as_bf16, as_bf16.new_zeros(len(w), 1)], 1) if inp % 2 else as_bf16
    packed = w.view(-1, GROUP, block, (inp + 1) // 2, 2).permute(0, 3, 1, 2, 4).contiguous()
    return packed if pairs else packed.flatten(-2)


def weight_mode(packed: torch.Tensor) -> int:
    """The C code's mode of a `pack_weight` result: 0 float32, 1 bfloat16 (float32 products),
    2 bfloat16 pairs (bfloat16 inputs), 3 int8 with column scales, 4 Q4 blocks, 5 Q8 blocks."""
    if packed.dtype == torch.int8:
        return 3
    if packed.dtype == torch.uint8:
        return 4 if packed.shape[2] == QB // 2 + 4 else 5
    return 2 if packed.dim() == 5 else int(packed.dtype == torch.bfloat16)


def linear_rows(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor,
                bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [T, in] @ weight.T + bias with the weight packed by `pack_weight`: [T, out]. Meant
    for T <= max_rows(lib); a tile of weights runs its rows a few at a time from cache."""
    x = x.contiguous()
    T, inp = x.shape
    y = x.new_empty(T, out_features)
    if lib.specserve_linear(x.data_ptr(), T, packed.data_ptr(), weight_mode(packed),
                            None if bias is None else bias.data_ptr(), out_features, inp,
                            y.data_ptr(), out_features, 0, torch.get_num_threads()):
        raise MemoryError("linear_rows: could not allocate the step's scratch memory")
    return y


class GreedyScreen:
    """A vocabulary projection's greedy rows through an int8 screen (`specserve_screen`): a
    row's logits exact where they may be its largest, -inf elsewhere, so that its argmax is
    the full product's, ties included, for about half the bytes of bfloat16 weights. Holds
    the int8 copy, its column scales and each block's sum of |q| per column [nblk, out].

    `rows`: the weight [out, in] row-major that the model keeps anyway (a tied embedding,
    read where it lies at each call): a candidate's exact logit then reads its column as one
    run of bytes, where the packed layout spreads it over `in` cache lines."""

    MAX_CANDIDATES = 1024       # per row; a row with more takes the whole product

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, packed: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
        out, inp = weight.shape
        self.rows = rows
        q, scale = quantize_int8(weight)
        absq = q.to(torch.int16).abs()
        absq = torch.cat([absq, absq.new_zeros(out, -inp % QB)], 1)
        self.lib, self.packed, self.out, self.inp = lib, packed, out, inp
        self.screen = pack_weight(weight, lib.specserve_block(), quantization="int8")
        self.scale = scale.contiguous()
        # at most QB * 127: the C side reads them as uint16
        self.absq = absq.view(out, -1, QB).sum(2).T.contiguous().to(torch.int16)
        self._args = _ScreenArgs(T=0, inp=inp, out=out, screen=self.screen.data_ptr(),
                                 absq=self.absq.data_ptr(), scale=self.scale.data_ptr(),
                                 wp=packed.data_ptr(), mode=weight_mode(packed),
                                 max_candidates=self.MAX_CANDIDATES)
        self.candidates = torch.zeros(0, dtype=torch.long)   # the last call's, per row

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What a call reads besides its candidates' columns."""
        return self.screen, self.absq, self.scale

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out]: exact logits at each row's candidates, -inf
        elsewhere (a row whose candidates were too many: all exact)."""
        x = x.contiguous()
        T = x.shape[0]
        y = x.new_empty(T, self.out)
        self.candidates = torch.empty(T, dtype=torch.long)
        a = self._args
        a.x, a.T, a.y, a.ncand = x.data_ptr(), T, y.data_ptr(), self.candidates.data_ptr()
        a.nthreads = torch.get_num_threads()
        r = self.rows            # float32 only: a model made float32 after the screen was built
        a.rows = (r.data_ptr() if r is not None and r.dtype == torch.float32
                  and r.is_contiguous() and r.shape == (self.out, self.inp) else None)
        if self.lib.specserve_screen(ctypes.byref(a)):
            raise MemoryError("GreedyScreen: could not allocate the step's scratch memory")
        return y


def read_once(lib: ctypes.CDLL, tensors: list[torch.Tensor]) -> int:
    """Reads the tensors' bytes once, in order, on torch's threads, and does nothing else
    (specserve_stream; a tensor's tail past a multiple of 256 bytes is left): what streaming
    them costs at the least, from wherever their pages lie. Returns the XOR of the 32-bit
    words read."""
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    sizes = (ctypes.c_int64 * len(tensors))(*[t.nbytes for t in tensors])
    return lib.specserve_stream(ptrs, sizes, len(tensors), torch.get_num_threads())


def rms_norm_rows(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """RMSNorm of x [..., n] (float32) in one C call: PyTorch's composite rms_norm is several
    operators, tens of microseconds for a single row."""
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.specserve_rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1],
                           x.shape[-1], y.data_ptr())
    return y


class CpuLayer:
    """A decoder layer's cached step of <= max_rows(lib) rows in one C call: `DecoderLayer`
    (target, draft model, EAGLE, MTP) or `Eagle3DecoderLayer` (its attention input given)."""

    def __init__(self, layer: torch.nn.Module, lib: ctypes.CDLL) -> None:
        at, mlp = layer.self_attn, layer.mlp
        in_norm = getattr(layer.input_layernorm, "weight", None)     # nn.Identity: EAGLE-1
        tensors = (in_norm, at.qkv_proj.kernel_weight, at.qkv_proj.bias,
                   None if at.q_norm is None else at.q_norm.weight,
                   None if at.k_norm is None else at.k_norm.weight, at.o_proj.kernel_weight,
                   layer.post_attention_layernorm.weight, mlp.gate_up_proj.kernel_weight,
                   mlp.down_proj.kernel_weight)
        assert all(t is None or t.is_contiguous() for t in tensors)
        self.lib = lib
        self._cache = None              # the KV cache last checked (its shape is in `shape`)
        self._keep = tensors            # the addresses below stay valid while these live
        self.weights = (_P * len(tensors))(*(None if t is None else t.data_ptr()
                                             for t in tensors))
        self.shape = _Shape(at.o_proj.out_features, at.num_heads, at.num_kv_heads, at.head_dim,
                            mlp.intermediate, at.qkv_proj.in_features, 0,
                            weight_mode(at.qkv_proj.kernel_weight), 0, 0,
                            layer.post_attention_layernorm.eps, at.scale)
        self._args = _LayerArgs(s=ctypes.pointer(self.shape), w=ctypes.cast(self.weights, _P))

    @staticmethod
    def supports(layer: torch.nn.Module) -> bool:
        """float32 on the CPU with every linear packed for the kernel (a DecodeLinear with a
        kernel weight), all four packed the same way, head_dim <= 1024."""
        at, mlp = layer.self_attn, layer.mlp
        packed = [getattr(lin, "kernel_weight", None)
                  for lin in (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        return (all(p is not None for p in packed) and len({weight_mode(p) for p in packed}) == 1
                and at.head_dim <= 1024
                and all(p.dtype == torch.float32 and p.device.type == "cpu"
                        and p.is_contiguous() for p in layer.parameters()))

    def __call__(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 md, cache: tuple[torch.Tensor, torch.Tensor],
                 attn_in: torch.Tensor | None = None,
                 reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """x [T, H] residual stream -> the layer's output [T, H] (x is not modified);
        cos_sin: rotary rows [T, 1, head_dim]; attn_in [T, attn_in width] or None. With
        `reduce` (a tensor-parallel shard), the attention and MLP outputs are partial sums:
        each is completed in place by reduce() before it is added to the stream."""
        k_cache, v_cache = cache                      # [num_slots, num_kv_heads, max_len, D]
        if cache is not self._cache:
            self.shape.kv_bf16 = kv_bf16(cache, "CpuLayer")
            self._cache = cache
            self.shape.max_len = k_cache.shape[2]
            self._args.k_cache, self._args.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        cos, sin = cos_sin                            # [T, 1, D] rows, rot_stride apart
        if cos.stride(-1) != 1 or sin.stride(0) != cos.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
        self.shape.rot_stride = cos.stride(0)
        out = x.clone(memory_format=torch.contiguous_format)
        if attn_in is not None:
            attn_in = attn_in.contiguous()
        mask = md.row_mask() if md.tree else None             # [T, max_kv] bool
        args = self._args               # the step's fields; the rest were set once
        args.T, args.x = out.shape[0], out.data_ptr()
        args.attn_in = None if attn_in is None else attn_in.data_ptr()
        args.slots, args.positions = md.token_slots.data_ptr(), md.positions.data_ptr()
        args.cos, args.sin = cos.data_ptr(), sin.data_ptr()
        args.mask = None if mask is None else mask.data_ptr()
        args.mask_stride = 0 if mask is None else mask.shape[1]
        args.nthreads = torch.get_num_threads()
        if reduce is None:
            args.half, args.out = 0, None
            _check_rc(self.lib.specserve_layer(ctypes.byref(args)), "CpuLayer")
            return out
        partial = torch.empty_like(out)                                   # [T, H]
        args.out = partial.data_ptr()
        for half in (1, 2):
            args.half = half
            _check_rc(self.lib.specserve_layer(ctypes.byref(args)), "CpuLayer")
            reduce(partial)
            out += partial
        return out


class _Chain:
    """Greedy chain drafting in one C call per engine step: at batch 1 the dozen PyTorch
    operators around each pass of a small drafter cost more than its weights. The drafts equal
    the PyTorch loop's over this kernel (the same C code computes every value)."""

    def __init__(self, lib: ctypes.CDLL, cos_sin: torch.Tensor,
                 caches: list[tuple[torch.Tensor, torch.Tensor]],
                 tensors: tuple[torch.Tensor | None, ...]) -> None:
        tensors = (cos_sin, *tensors, *(t for c in caches for t in c))
        if not all(t is None or (t.is_contiguous() and t.device.type == "cpu") for t in tensors):
            raise ValueError(f"{type(self).__name__}: every tensor must be contiguous on the CPU")
        self.lib, self._keep = lib, tensors         # the pointers stay valid while these live
        # rotary rows and KV positions a chain may write (positions[b] .. positions[b] +
        # budgets[b] - 2); the C side checks the KV length again, not the rotary table
        self.max_positions = min(cos_sin.shape[0], *(k.shape[2] for k, _ in caches))
        self.ptrs = [None if t is None else t.data_ptr() for t in tensors]

    def _ints(self, slots: list[int], positions: list[int], budgets: list[int]
              ) -> torch.Tensor:
        """[3, B] slots, first positions and budgets, checked against the rotary table and
        KV cache (a chain writes positions[b] .. positions[b] + budgets[b] - 2)."""
        self._check_end(max(p + n - 1 for p, n in zip(positions, budgets)), "draft")
        return torch.tensor([slots, positions, budgets], dtype=torch.long)

    @staticmethod
    def _drafts(tokens: torch.Tensor, ints: torch.Tensor) -> list[list[int]]:
        """Each request's drafts from tokens [B, max budget]: its budget as drafted (fewer
        where one fell below the threshold)."""
        return [t[:n] for t, n in zip(tokens.tolist(), ints[2].tolist())]

    def _ingest(self, ids: list[int], row_slots: list[int], row_positions: list[int],
                last: list[int]) -> tuple[dict, torch.Tensor]:
        """The ingest fields of a chain's C call: T rows (token ids[t] at row_positions[t] of
        slot row_slots[t]) and the drafting requests' rows `last`, checked against the rotary
        table and KV cache. The tensor returned holds them and must live until the call."""
        self._check_end(max(row_positions) + 1, "ingest")
        T = len(ids)
        ints = torch.tensor([*ids, *row_slots, *row_positions, *last], dtype=torch.long)
        at = [ints.data_ptr() + i * T * ints.element_size() for i in range(4)]
        return {"T": T, "in_tok": at[0], "in_slot": at[1], "in_pos": at[2], "last": at[3]}, ints

    def _check_end(self, end: int, what: str) -> None:
        """Refuse positions from `end` on (the C code reads rotary rows unchecked)."""
        if end > self.max_positions:
            raise ValueError(f"{type(self).__name__}: {what} positions past the "
                             f"{self.max_positions} of the rotary table or KV cache")


class HeadChain(_Chain):
    """The chain of a head that drafts from its own state (`specserve_head_chain`): EAGLE-1
    (fc with bias, no norms), EAGLE-3 (no fc: the normed halves are its layer's attention
    input; a draft vocabulary with d2t), MTP (fc with enorm and hnorm, a final norm); built by
    `compiled_chain` (models/cpu_backend.py). Weights `fc` and `lm_head` are packed
    (`pack_weight`)."""

    def __init__(self, layer: CpuLayer, embed: torch.Tensor, e_norm: torch.Tensor | None,
                 h_norm: torch.Tensor | None, fc: torch.Tensor | None,
                 fc_bias: torch.Tensor | None, final_norm: torch.Tensor | None,
                 lm_head: torch.Tensor, vocab: int, d2t: torch.Tensor | None,
                 cos_sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(layer.lib, cos_sin, [cache],
                         (embed, e_norm, h_norm, fc, fc_bias, final_norm, lm_head, d2t))
        self.layer, self.vocab = layer, vocab
        self.shape = _Shape.from_buffer_copy(layer.shape)
        self.shape.max_len, self.shape.kv_bf16 = cache[0].shape[2], kv_bf16(cache, "HeadChain")
        self.fc_mode = 0 if fc is None else weight_mode(fc)
        self.lm_mode = weight_mode(lm_head)

    def __call__(self, state: torch.Tensor, positions: list[int], slots: list[int],
                 budgets: list[int], threshold: float = 0.0) -> list[list[int]]:
        """budgets[b] greedy drafts for each row of state [B, H] (the head output at each
        request's last verified position), the first fed at positions[b] of KV slot slots[b];
        with a threshold a request stops after its first draft the head gives a lower
        probability."""
        state = state.contiguous().clone()                       # the C call overwrites it
        return self._draft({"T": 0}, state, positions, slots, budgets, threshold)

    def after_ingest(self, ids: list[int], h: torch.Tensor, row_slots: list[int],
                     row_positions: list[int], last: list[int], positions: list[int],
                     slots: list[int], budgets: list[int],
                     threshold: float = 0.0) -> list[list[int]]:
        """The head's pass over the T rows the target verified (token ids[t] with its feature
        h [T, H], fuse_target's output, at row_positions[t] of slot row_slots[t]), as its
        forward would run it, then __call__ from the output rows `last` (one per drafting
        request): one C call instead of the PyTorch pass and the chain."""
        ingest, _alive = self._ingest(ids, row_slots, row_positions, last)   # until the call
        h = h.contiguous().clone()                               # the C call overwrites it
        state = h.new_empty(len(last), h.shape[1])
        return self._draft(ingest | {"in_h": h.data_ptr()}, state, positions, slots, budgets,
                           threshold)

    def _draft(self, ingest: dict, state: torch.Tensor, positions: list[int],
               slots: list[int], budgets: list[int], threshold: float) -> list[list[int]]:
        n = max(budgets)
        ints = self._ints(slots, positions, budgets)                          # [3, B]
        tokens = torch.empty(len(slots), n, dtype=torch.long)
        cos_sin, emb, e_n, h_n, fc, fc_b, fin_n, lm, d2t, k, v = self.ptrs
        args = _HeadChainArgs(
            s=ctypes.pointer(self.shape), B=len(slots), n=n, state=state.data_ptr(),
            slots=ints[0].data_ptr(), pos0=ints[1].data_ptr(), budget=ints[2].data_ptr(),
            threshold=threshold, embed=emb, e_norm=e_n, h_norm=h_n, fc=fc, fc_mode=self.fc_mode,
            fc_bias=fc_b, final_norm=fin_n, lm_head=lm, lm_mode=self.lm_mode, vocab=self.vocab,
            d2t=d2t, cos_sin=cos_sin, w=ctypes.cast(self.layer.weights, _P), k_cache=k,
            v_cache=v, tokens=tokens.data_ptr(), nthreads=torch.get_num_threads(), **ingest)
        _check_rc(self.lib.specserve_head_chain(ctypes.byref(args)), type(self).__name__)
        return self._drafts(tokens, ints)


class _LayerArrays:
    """The per-layer C arrays of a whole model's call (`specserve_llama_chain`,
    `specserve_llama_forward`): shapes and weight tables of its CpuLayers, and once caches
    are given (`use`), the KV pointers with each shape's max_len."""

    def __init__(self, layers: list[CpuLayer]) -> None:
        self.lib, self.num_layers = layers[0].lib, len(layers)
        self.shapes = (_Shape * len(layers))(*(_Shape.from_buffer_copy(x.shape) for x in layers))
        self.weights = (_P * len(layers))(*(ctypes.cast(x.weights, _P) for x in layers))
        self.k = self.v = None

    def use(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for sh, (k, v) in zip(self.shapes, caches):
            sh.max_len, sh.kv_bf16 = k.shape[2], kv_bf16((k, v), "the kernel")
        self.k = (_P * len(caches))(*(k.data_ptr() for k, _ in caches))
        self.v = (_P * len(caches))(*(v.data_ptr() for _, v in caches))


class LlamaChain(_Chain):
    """A draft model's chain (`specserve_llama_chain`); built by
    `compiled_chain` (models/cpu_backend.py)."""

    def __init__(self, layers: list[CpuLayer], embed: torch.Tensor, final_norm: torch.Tensor,
                 lm_head: torch.Tensor, vocab: int, cos_sin: torch.Tensor,
                 caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__(layers[0].lib, cos_sin, caches, (embed, final_norm, lm_head))
        self.vocab, self.arrays = vocab, _LayerArrays(layers)
        self.arrays.use(caches)
        self.lm_mode = weight_mode(lm_head)

    def __call__(self, first: list[int], positions: list[int], slots: list[int],
                 budgets: list[int], threshold: float = 0.0) -> list[list[int]]:
        """budgets[b] greedy drafts per request, the first given (`first[b]`, picked from the
        catch-up pass) and fed at positions[b] of KV slot slots[b]; with a threshold a request
        stops after its first later draft the model gives a lower probability (the caller
        checks the first)."""
        tokens = torch.zeros(len(slots), max(budgets), dtype=torch.long)
        tokens[:, 0] = torch.tensor(first)
        return self._draft({"T": 0}, tokens, positions, slots, budgets, threshold)

    def after_ingest(self, ids: list[int], row_slots: list[int], row_positions: list[int],
                     last: list[int], positions: list[int], slots: list[int],
                     budgets: list[int], threshold: float = 0.0) -> list[list[int]]:
        """The draft's pass over the T rows it has not seen (token ids[t] at row_positions[t] of
        slot row_slots[t]), as its forward would run it, then __call__ with each drafting
        row's first draft from the pass's output row last[b] (rising), the threshold applying
        to it too: one C call instead of the PyTorch pass and the chain."""
        ingest, _alive = self._ingest(ids, row_slots, row_positions, last)   # until the call
        tokens = torch.empty(len(slots), max(budgets), dtype=torch.long)
        return self._draft(ingest, tokens, positions, slots, budgets, threshold)

    def _draft(self, ingest: dict, tokens: torch.Tensor, positions: list[int],
               slots: list[int], budgets: list[int], threshold: float) -> list[list[int]]:
        cos_sin, emb, fin_n, lm = self.ptrs[:4]
        a = self.arrays
        ints = self._ints(slots, positions, budgets)                          # [3, B]
        args = _LlamaChainArgs(
            s=ctypes.cast(a.shapes, ctypes.POINTER(_Shape)), L=a.num_layers, B=len(slots),
            n=tokens.shape[1], slots=ints[0].data_ptr(), pos0=ints[1].data_ptr(),
            budget=ints[2].data_ptr(), threshold=threshold, embed=emb, final_norm=fin_n,
            lm_head=lm, lm_mode=self.lm_mode, vocab=self.vocab, cos_sin=cos_sin,
            w=ctypes.cast(a.weights, _P), k_cache=ctypes.cast(a.k, _P),
            v_cache=ctypes.cast(a.v, _P), tokens=tokens.data_ptr(),
            nthreads=torch.get_num_threads(), **ingest)
        _check_rc(self.lib.specserve_llama_chain(ctypes.byref(args)), type(self).__name__)
        return self._drafts(tokens, ints)


class LlamaForward:
    """A Llama-family model's cached step in one C call (`specserve_llama_forward`): the
    embedding, every layer and the final norm, instead of a dozen PyTorch operators and a C
    call per layer (at batch 1 those cost about a quarter of a bfloat16 decode step of the
    bundled target, in a throwaway A/B). The values are those of the layer-by-layer path
    through this kernel. Built by `use_decode_linears`."""

    def __init__(self, layers: list[CpuLayer], embed: torch.Tensor, final_norm: torch.Tensor,
                 eps: float, cos_sin: torch.Tensor,
                 reduce: SharedMemoryAllReduce | None = None) -> None:
        """With `reduce` (a tensor-parallel shard), each layer's attention and MLP halves are
        summed over the ranks inside the call, through its shared memory."""
        tensors = (embed, final_norm, cos_sin)
        if not all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors):
            raise ValueError("LlamaForward: embedding, norm and rotary table must be "
                             "contiguous float32")
        self.lib, self._keep = layers[0].lib, tensors
        self.arrays = a = _LayerArrays(layers)
        self._caches = None
        # the fields that stay from step to step, set once (a struct costs microseconds); not
        # the tensors' addresses: a head that shares the embedding may move its storage
        self._args = _LlamaForwardArgs(s=ctypes.cast(a.shapes, ctypes.POINTER(_Shape)),
                                       L=a.num_layers, eps=eps, w=ctypes.cast(a.weights, _P))
        self.reduce = reduce            # its struct's part numbers go on from either path
        if reduce is not None:
            self._args.ar = ctypes.addressof(reduce._args)
        self._aux_ids: dict[tuple[int, ...], torch.Tensor] = {}

    def _use(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Checks a new cache list once: its rows are indexed unchecked in C, and every
        position a step writes (below the cache length) must have its rotary row."""
        if caches is self._caches:
            return
        rotary = self._keep[2].shape[0]
        if any(k.shape[2] > rotary for k, _ in caches):
            raise ValueError(f"LlamaForward: the KV cache holds more positions than the "
                             f"rotary table ({rotary})")
        self.arrays.use(caches)
        self._args.k_cache = ctypes.cast(self.arrays.k, _P)
        self._args.v_cache = ctypes.cast(self.arrays.v, _P)
        self._caches = caches

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, md,
                 caches: list[tuple[torch.Tensor, torch.Tensor]], aux_layers: tuple[int, ...]):
        """ids, positions (rotary) [T] long -> final hidden states [T, H], and with aux_layers
        also the inputs of those layers [T, len(aux_layers) * H]."""
        self._use(caches)
        a = self.arrays
        T, H = ids.shape[0], a.shapes[0].hidden
        hidden = torch.empty(T, H)
        aux = torch.empty(T, len(aux_layers) * H) if aux_layers else None
        aux_ids = self._aux_ids.get(aux_layers)
        if aux_ids is None:
            aux_ids = self._aux_ids[aux_layers] = torch.tensor(aux_layers, dtype=torch.long)
        mask = md.row_mask() if md.tree else None                       # [T, max_kv] bool
        args, (embed, final_norm, cos_sin) = self._args, self._keep
        args.embed, args.final_norm = embed.data_ptr(), final_norm.data_ptr()
        args.cos_sin = cos_sin.data_ptr()
        args.T, args.ids, args.slots = T, ids.data_ptr(), md.token_slots.data_ptr()
        args.positions, args.rope = md.positions.data_ptr(), positions.data_ptr()
        args.mask = None if mask is None else mask.data_ptr()
        args.mask_stride = 0 if mask is None else mask.shape[1]
        args.n_aux, args.aux_layers = len(aux_layers), aux_ids.data_ptr()
        args.aux = None if aux is None else aux.data_ptr()
        args.hidden, args.nthreads = hidden.data_ptr(), torch.get_num_threads()
        rc = self.lib.specserve_llama_forward(ctypes.byref(args))
        if rc == -3:
            self.reduce.missed("LlamaForward")
        _check_rc(rc, "LlamaForward")
        return (hidden, aux) if aux_layers else hidden


class KVWriter:
    """Keys and values made outside a layer's step, written to L layers' caches in one C call
    (`specserve_write_kv`) as each layer's step writes its own: keys normed per head by
    `k_norm` [L, D] (None: not normed), then rotated at their position by `cos_sin` [positions,
    2, D]. DFlash's context write, a dozen PyTorch operators otherwise."""

    def __init__(self, lib: ctypes.CDLL, caches: list[tuple[torch.Tensor, torch.Tensor]],
                 k_norm: torch.Tensor | None, eps: float, cos_sin: torch.Tensor) -> None:
        k0 = caches[0][0]
        bf16 = {kv_bf16(c, "KVWriter") for c in caches}
        if len(bf16) != 1 or any(k.shape != k0.shape for k, _ in caches):
            raise ValueError("KVWriter: the layers' caches must share one shape and dtype")
        _, NKV, max_len, D = k0.shape
        if cos_sin.shape[0] < max_len:
            raise ValueError(f"KVWriter: the rotary table ({cos_sin.shape[0]} positions) is "
                             f"shorter than the KV cache ({max_len})")
        cos_sin = cos_sin.float().contiguous()
        k_norm = None if k_norm is None else k_norm.float().reshape(len(caches), D).contiguous()
        k_ptrs = (_P * len(caches))(*(k.data_ptr() for k, _ in caches))
        v_ptrs = (_P * len(caches))(*(v.data_ptr() for _, v in caches))
        self.lib, self._keep = lib, (caches, cos_sin, k_norm, k_ptrs, v_ptrs)
        self.width = len(caches) * 2 * NKV * D
        self._args = _WriteKVArgs(
            L=len(caches), NKV=NKV, D=D, max_len=max_len,
            k_norm=None if k_norm is None else k_norm.data_ptr(), eps=eps,
            cos_sin=cos_sin.data_ptr(), k_cache=ctypes.cast(k_ptrs, _P),
            v_cache=ctypes.cast(v_ptrs, _P), kv_bf16=bf16.pop())

    def __call__(self, kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """kv [T, L * 2 * NKV * D] float32 (each layer's keys, then its values) of the rows at
        `positions` [T] (long) of KV slots `slots` [T] (long)."""
        kv = kv.float().contiguous()
        if kv.shape[-1] != self.width or slots.dtype != torch.long or positions.dtype != torch.long:
            raise ValueError(f"KVWriter: kv must be [T, {self.width}] with long slots and "
                             "positions")
        a = self._args
        a.kv, a.T = kv.data_ptr(), kv.shape[0]
        a.slots, a.positions = slots.contiguous().data_ptr(), positions.contiguous().data_ptr()
        _check_rc(self.lib.specserve_write_kv(ctypes.byref(a)), "KVWriter")


class SharedMemoryAllReduce:
    """In-place sum over the `size` tensor-parallel ranks of one machine, through `shm` (a
    tensor in memory all ranks share, of `shm_numel(size, cap)` int64, zeros at first; see
    specserve_all_reduce). Each rank's caller must call it in the same order with tensors of
    the same size. A wait ends when a process in `peers` (rank 0's workers) or `parent` (a
    worker's rank 0) exits, or after `timeout_s` (a layer's half of a long prompt chunk on a
    slow machine takes far less); `check_peers()` then raises naming the rank that is gone."""

    TIMEOUT_S = 120.0

    def __init__(self, lib: ctypes.CDLL, shm: torch.Tensor, rank: int, size: int, cap: int,
                 check_peers: Callable[[], None], peers: tuple[int, ...] = (), parent: int = 0,
                 timeout_s: float = TIMEOUT_S) -> None:
        if not shm.is_shared() or shm.numel() < shm_numel(size, cap):
            raise ValueError("SharedMemoryAllReduce: shm must be a shared tensor of "
                             f"{shm_numel(size, cap)} int64")
        self.lib, self._shm, self.check_peers = lib, shm, check_peers
        self._peers = (ctypes.c_int32 * max(1, len(peers)))(*peers)
        self._args = _AllReduceArgs(shm=shm.data_ptr(), cap=cap, rank=rank, size=size,
                                    timeout_s=timeout_s, peers=ctypes.cast(self._peers, _P),
                                    npeers=len(peers), parent=parent)

    def __call__(self, x: torch.Tensor) -> None:
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("SharedMemoryAllReduce: x must be contiguous float32")
        self._args.x, self._args.n = x.data_ptr(), x.numel()
        rc = self.lib.specserve_all_reduce(ctypes.byref(self._args))
        if rc == -3:
            self.missed("SharedMemoryAllReduce")
        _check_rc(rc, "SharedMemoryAllReduce")

    def missed(self, who: str) -> None:
        """A wait that ended without every rank's part: WorkerDied (or what check_peers
        raises) when a rank is gone, else a RuntimeError."""
        self.check_peers()
        raise RuntimeError(f"{who}: a tensor-parallel rank did not come to an all-reduce "
                           f"within {self._args.timeout_s:.0f} s")


class SharedMemoryChannel:
    """Rank 0's messages to the other ranks of its machine, one at a time, through `shm` (a
    shared uint8 tensor, zeros at first; see specserve_channel_post): `send` never waits (a
    message may be sent once every rank has read the one before); `receive` waits, running
    `check_peers()` every `poll_s`."""

    HEADER = 64             # the futex word (uint32), then the message's length (int64 at 8)

    def __init__(self, lib: ctypes.CDLL, shm: torch.Tensor, check_peers: Callable[[], None],
                 poll_s: float = 0.1) -> None:
        if not shm.is_shared() or shm.dtype != torch.uint8 or shm.numel() <= self.HEADER:
            raise ValueError("SharedMemoryChannel: shm must be a shared uint8 tensor")
        self.lib, self._shm, self.check_peers = lib, shm, check_peers
        self._length, self._bytes = shm[8:16].view(torch.int64), shm[self.HEADER:]
        self._args = _ChannelArgs(shm=shm.data_ptr(), seen=0, timeout_s=poll_s)

    def send(self, data: bytes) -> None:
        if len(data) > self._bytes.numel():
            raise ValueError(f"SharedMemoryChannel: a message of {len(data)} bytes does not fit "
                             f"in {self._bytes.numel()}")
        if data:
            self._bytes[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._length[0] = len(data)
        self.lib.specserve_channel_post(ctypes.byref(self._args))

    def receive(self) -> bytes:
        while self.lib.specserve_channel_wait(ctypes.byref(self._args)) == 1:
            self.check_peers()
        self._args.seen += 1
        return self._bytes[:int(self._length[0])].numpy().tobytes()


def shm_numel(size: int, cap: int) -> int:
    """int64 elements of SharedMemoryAllReduce's shared tensor: counters and two buffers."""
    return 8 * size + size * cap       # 2 * size * cap float32 = size * cap int64


def kv_bf16(cache: tuple[torch.Tensor, torch.Tensor], who: str) -> int:
    """1 where a layer's KV cache holds bfloat16, 0 for float32 (what the kernel reads)."""
    k, v = cache
    if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype
            and k.dtype in (torch.float32, torch.bfloat16)):
        raise ValueError(f"{who}: KV cache tensors must be contiguous float32 or bfloat16")
    return int(k.dtype == torch.bfloat16)


def _check_rc(rc: int, who: str) -> None:
    if rc == -2:
        raise ValueError(f"{who}: the C side refused a position outside the KV cache or a draft "
                         "budget above the chain's length")
    if rc != 0:
        raise MemoryError(f"{who}: could not allocate the step's scratch memory")


def kernel_step(md, x: torch.Tensor, lib: ctypes.CDLL) -> bool:
    """Whether a cached step of rows `x` [T, ...] goes through the kernel: at most
    max_rows(lib) rows (causal runs or draft-tree nodes)."""
    return md is not None and x.shape[0] <= max_rows(lib)
