"""The compiled CPU kernel (kernel.c) and its ctypes binding; see README.md here."""

from specserve.kernels.cpu.binding import (
                                           BLOCK_TYPES,
                                           CpuLayer,
                                           GreedyScreen,
                                           HeadChain,
                                           KVWriter,
                                           LlamaChain,
                                           LlamaForward,
                                           SharedMemoryAllReduce,
                                           SharedMemoryChannel,
                                           cpu_features,
                                           cpu_flags,
                                           kernel_step,
                                           linear_rows,
                                           load_library,
                                           max_rows,
                                           pack_weight,
                                           quantize_blocks,
                                           quantize_int8,
                                           read_once,
                                           rms_norm_rows,
                                           shm_numel,
                                           weight_mode,
)

__all__ = ["BLOCK_TYPES", "CpuLayer", "GreedyScreen", "HeadChain", "KVWriter", "LlamaChain", "LlamaForward",
           "SharedMemoryAllReduce", "SharedMemoryChannel", "cpu_features",
           "cpu_flags", "kernel_step",
           "linear_rows", "load_library", "max_rows", "pack_weight",
           "quantize_blocks", "quantize_int8", "read_once", "rms_norm_rows", "shm_numel",
           "weight_mode"]
