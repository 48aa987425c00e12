"""Native CPU kernels (compiled on first use) with a torch-only fallback decided once per process.

The Python bindings mirror the C++ sources, one module per family; import the family you use
(`from kvserve.kernels import attention`, then `attention.paged_decode_attention(...)`):

- `library`: loading the compiled library once (`build` compiles it) and what the bindings share:
  `cpu_kernels_available`, `supports`, the dtype codes, the status checks
- `attention`: paged decode and prefill attention over the KV pool, `kv_view` (paged_attention.cpp)
- `kv_formats`: the KV cache's format codes and the store kernel of the scaled ones (kv_store.cpp)
- `hadamard`: the Walsh-Hadamard rotation of head vectors (hadamard.cpp)
- `products`: float, packed bf16 and AMX products on weights packed once (float_matmul.cpp,
  packed_matmul.cpp, amx_matmul.cpp)
- `gguf`: products, dequantization and the Q8_0 screen on GGUF blocks (gguf_matmul.cpp)
- `sampling`: the sampler and the int8-screened lm_head (sampler.cpp, screened_argmax.cpp,
  screened_sampler.cpp)
- `fused`: RMS norms, q/k norm + rotary, gated activation (fused_ops.cpp)
- `program`: a decode step's layers as one call of the same kernels (decode_program.cpp)
- `args`: the ctypes mirrors of the argument structs (args.h), checked against the library (abi.cpp)
"""
