"""The bytes a loaded model's weights take, as held: every tensor the kernels read, each counted once."""

from __future__ import annotations

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters, the kernels' packed copies (packed bf16, float tiles, AMX tiles), GGUF blocks, the
    lm_head's copies and its screens' tables; a tensor shared by two of them (a tied embedding) once."""
    tensors = list(model.parameters())
    for name in ("packed", "float_packed", "amx"):
        tensors += [getattr(m, name).data for m in model.modules() if getattr(m, name, None) is not None]
    tensors += [part.data for module in model.modules() for part in getattr(module, "gguf", None) or ()]  # Linear's GGUF parts
    embedding = getattr(model.embed_tokens, "blocks", None)  # GgufEmbedding
    if embedding is not None:
        tensors.append(embedding.data)
    for packed in (model.packed_lm_head, model.amx_lm_head, model.float_lm_head, model.gguf_lm_head):
        if packed is not None:
            tensors.append(packed.data)
    if model.gguf_screen is not None:  # a Q8_0 lm_head's screen bounds
        tensors += [model.gguf_screen.block_bound, model.gguf_screen.tile_l1]
    screened = model.screened_lm_head
    if screened is not None:
        tensors += [screened.int8, screened.row_scale, screened.row_error, screened.row_abs_q, screened.tile_abs_q, screened.tile_error]
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(unique.values())
