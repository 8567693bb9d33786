"""Run this process on the AVX2 kernels, on any x86-64 CPU that has AVX2 (AVX-512 ones included).

``benchmarks/policy_lag_experiment.py`` puts this folder on a cell's ``PYTHONPATH`` (``--cpu-kernels avx2``, the
default), so Python imports this module at start-up in the cell process and in every process it spawns, before any
of them runs a kernel. Why: the committed cells ran on an AVX2-only AMD EPYC, and a cell is reproducible only on the
same kernels. On an AVX-512 (with BF16) AMD EPYC the native kernels rebuilt the warm start to 230/512 held-out instead
of the committed 203/512 (its first step already sampled other completions); with this module the first steps were
bit-identical to the committed ones (RESULTS.md, "Policy lag").

What it pins:

* ATen (PyTorch's CPU kernels, the float32 trainer): ``ATEN_CPU_CAPABILITY=avx2``;
* oneDNN, in torch and in vLLM's CPU extension: ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` = ``AVX2``;
* torch.compile's cache: its own folder (``TORCHINDUCTOR_CACHE_DIR``), as the capability is not in its key;
* vLLM CPU, which picks its extension (``vllm._C_AVX2`` vs the AVX-512 builds), its attention kernels and its AMX
  paths from ``torch.cpu._is_avx512_supported`` and its siblings: they report ``False`` here.

A variable already in the environment wins (``os.environ.setdefault``)."""

import os

for _var, _value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("DNNL_MAX_CPU_ISA", "AVX2")):
    os.environ.setdefault(_var, _value)
# torch.compile's disk cache does not key on the capability, and kernels cached at other kernels gave wrong values
# (tests/conftest.py): a cache of its own (the cells do not compile; a user of this pin might)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_avx2_pinned")

try:
    import torch
except ImportError:  # a helper process without torch: nothing else to pin
    pass
else:
    for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _probe):
            setattr(torch.cpu, _probe, lambda: False)
