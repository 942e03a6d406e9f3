"""The compiled few-row CPU forward (`cpu_kernel.c`) for float32 Llama-family models.

Eager PyTorch spends a batch-1 decode step of a small model mostly outside the weights: some
twenty kernel launches per layer, and one-row matrix products that read the weights at well
under the memory bandwidth (RESULTS runs 17 and 19). `CpuDecoder` runs the whole layer stack
of a step of up to `MAX_ROWS` causal rows in one C call, and `linear_rows` does the same for one
matrix (lm_head, draft heads). Each output element is computed the same way whatever else is in
the step, so results do not depend on batch composition.

The C file is compiled on first use with the machine's C compiler (`$CC`, default `cc`) into
`~/.cache/specserve/kernels` (or `$XDG_CACHE_HOME`); where that fails, a warning says so and
the PyTorch path runs. Prompt chunks longer than `MAX_ROWS` and draft trees (which need a
mask) always take the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernel.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# Steps of up to this many rows (decode, verify, a batch of either) take the kernel; it reads
# each weight once per 16 rows. Longer prompt chunks take oneDNN's blocked matrix multiply,
# which reuses weights across many rows (the two cost the same near 64 rows; run 19).
MAX_ROWS = 48
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class _Shape(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate", "num_layers", "max_len")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


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


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per source, compiler and CPU; None when it cannot be."""
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *FLAGS, _cpu_id())).encode())
    path = _cache_dir() / f"cpu_kernel-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                subprocess.run([cc, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, path)        # atomic: a concurrent build cannot half-write
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"specserve: the CPU decode kernel could not be built with {cc!r} "
                      f"({detail}); running the slower PyTorch path. Install a C compiler with "
                      "OpenMP (gcc) or set CC to one.", RuntimeWarning, stacklevel=2)
        return None
    lib.specserve_linear.argtypes = [_P, _I64, _P, _P, _I64, _I64, _P, _I64, ctypes.c_int,
                                     ctypes.c_int]
    lib.specserve_linear.restype = None
    lib.specserve_decode.argtypes = [ctypes.POINTER(_Shape), _I64, _P, _P, _P, _P, _P, _P, _P,
                                     _P, _P, _P, _I64, _P, ctypes.c_int]
    lib.specserve_decode.restype = ctypes.c_int
    return lib


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the kernel's layout [ceil(out / 64) * 4, in, 16]: blocks of 16 output
    columns, each block's inputs contiguous; the padding columns are zero and never stored."""
    out, inp = weight.shape
    w = weight.detach()
    if out % 64:
        w = torch.cat([w, w.new_zeros(-out % 64, inp)])
    return w.view(-1, 16, inp).transpose(1, 2).contiguous()


def linear_rows(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor,
                bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [T, in] @ weight.T + bias with the weight packed by `pack_weight`: [T, out]. Meant
    for T <= MAX_ROWS; more rows work but re-read the weight every 16 rows."""
    x = x.contiguous()
    T, inp = x.shape
    y = x.new_empty(T, out_features)
    lib.specserve_linear(x.data_ptr(), T, packed.data_ptr(),
                         None if bias is None else bias.data_ptr(), out_features, inp,
                         y.data_ptr(), out_features, 0, torch.get_num_threads())
    return y


class CpuDecoder:
    """`LlamaForCausalLM.forward` for cached steps of <= MAX_ROWS rows that form causal runs."""

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL) -> None:
        a = model.args
        self.lib, self.model = lib, model
        attn = model.layers[0].self_attn
        self.shape = _Shape(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                            a.head_dim, a.intermediate_size, a.num_hidden_layers, 0,
                            a.rms_norm_eps, attn.scale)
        ptrs: list[int | None] = []
        for layer in model.layers:
            at, mlp = layer.self_attn, layer.mlp
            tensors = (layer.input_layernorm.weight, at.qkv_proj.kernel_weight,
                       at.qkv_proj.bias, at.q_norm.weight if at.q_norm is not None else None,
                       at.k_norm.weight if at.k_norm is not None else None,
                       at.o_proj.kernel_weight, layer.post_attention_layernorm.weight,
                       mlp.gate_up_proj.kernel_weight, mlp.down_proj.kernel_weight)
            assert all(t is None or t.is_contiguous() for t in tensors)
            ptrs.extend(None if t is None else t.data_ptr() for t in tensors)
        # The parameters are held by the model; these are their addresses, read once.
        self.weights = (_P * len(ptrs))(*ptrs)
        self._caches: tuple[list, object, object] | None = None     # (list, keys, values)

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """float32 on the CPU, every linear of the layers packed for the kernel (DecodeLinear
        with a kernel weight), contiguous norms and rotary tables."""
        p = model.embed_tokens.weight
        linears = [lin for layer in model.layers for lin in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        return (p.device.type == "cpu" and p.dtype == torch.float32
                and model.args.head_dim <= 1024
                and all(getattr(lin, "kernel_weight", None) is not None for lin in linears)
                and all(t.is_contiguous() for t in model.parameters()))

    def _cache_ptrs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        if self._caches is None or self._caches[0] is not kv_caches:
            k0 = kv_caches[0][0]
            a = self.model.args
            if (k0.dtype != torch.float32 or k0.dim() != 4 or k0.shape[1] != a.num_key_value_heads
                    or k0.shape[3] != a.head_dim or not all(k.is_contiguous() and v.is_contiguous()
                                                            for k, v in kv_caches)):
                raise ValueError("CpuDecoder: KV cache tensors must be contiguous float32 "
                                 "[num_slots, num_kv_heads, max_len, head_dim]")
            self.shape.max_len = k0.shape[2]
            self._caches = (kv_caches, (_P * len(kv_caches))(*(k.data_ptr() for k, _ in kv_caches)),
                            (_P * len(kv_caches))(*(v.data_ptr() for _, v in kv_caches)))
        return self._caches[1], self._caches[2]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], aux_layers: tuple[int, ...]):
        """input_ids, positions, token_slots: [T] -> final hidden [T, H] (and the aux layers'
        inputs [T, len(aux_layers) * H] when asked), like LlamaForCausalLM.forward."""
        m = self.model
        keys, values = self._cache_ptrs(kv_caches)
        x = m.embed_tokens(input_ids).contiguous()                          # [T, H]
        T, H = x.shape
        aux = x.new_empty(T, len(aux_layers) * H) if aux_layers else None
        aux_ids = (_I64 * len(aux_layers))(*aux_layers)
        positions, token_slots = positions.contiguous(), token_slots.contiguous()
        rc = self.lib.specserve_decode(
            ctypes.byref(self.shape), T, x.data_ptr(), token_slots.data_ptr(),
            positions.data_ptr(), self.weights, keys, values, m.rotary.cos.data_ptr(),
            m.rotary.signed_sin.data_ptr(), m.norm.weight.data_ptr(), aux_ids, len(aux_layers),
            None if aux is None else aux.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("CpuDecoder: could not allocate the step's scratch memory")
        return (x, aux) if aux_layers else x
