"""Tiny random checkpoints built with transformers configs, saved with save_pretrained."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

VOCAB = 512

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


def _config(family: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,  # GQA with groups of three
        # llama/qwen2: 24, not a power of two (the kernels' scalar paths); qwen3/gemma3: 32 (their vector paths)
        head_dim=32 if family.startswith(("qwen3", "gemma3")) else 24,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama-long":  # prompts of 1,000+ tokens
        return tf.LlamaConfig(**{**common, "max_position_embeddings": 2048}, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**common, rope_theta=1_000_000.0, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**common, rope_theta=1_000_000.0, tie_word_embeddings=False)
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **common,
            sliding_window=12,  # shorter than the test prompts
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=32,
        )
    if family == "gemma3-sliding":  # every layer sliding: nothing for KV eviction to compress
        return tf.Gemma3TextConfig(**common, sliding_window=12, layer_types=["sliding_attention"] * 3, query_pre_attn_scalar=32)
    if family.startswith("gemma3-w"):  # gemma3-w4, gemma3-w8: 4 sliding and 2 full layers, KV groups of two layers
        sliding, full = "sliding_attention", "full_attention"
        return tf.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6},
            sliding_window=int(family.removeprefix("gemma3-w")),
            layer_types=[sliding, sliding, full, sliding, sliding, full],
            query_pre_attn_scalar=32,
        )
    raise ValueError(family)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = Path("/usr/share/common-licenses/GPL-3").read_text().splitlines()
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


@functools.lru_cache(maxsize=None)
def tiny_model_dir(family: str, root: str) -> Path:
    """Build (once per session) a random model of `family` with weights large enough that argmax is stable."""
    from transformers import AutoModelForCausalLM

    out = Path(root) / family
    if (out / "config.json").exists():
        return out
    torch.manual_seed(1234)
    config = _config(family)
    config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family.startswith("gemma3") else 1.0, 0.1)
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
        if family.startswith("gemma3"):
            # tied embeddings times sqrt(hidden) would make the model echo its last token
            model.get_input_embeddings().weight.mul_(0.1)
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return out


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


# the tensor types tiny_gguf(quantized=True) writes: both fused projections mix types; attn_output
# (144 inputs, no whole blocks of 32) stays F32
TINY_GGUF_TYPES = {
    "token_embd": "Q8_0", "output": "Q4_1", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "Q4_1",
    "ffn_down": "Q5_1",
}  # fmt: skip


def tiny_gguf(root: str, quantized: bool = False, types: dict[str, str] | None = None, kv_heads: int | None = None) -> Path:
    """The tiny Llama's weights as a GGUF file with llama metadata (no tokenizer): F32, or with its
    tensors quantized as TINY_GGUF_TYPES (or `types`) says. Loads as weights. `kv_heads`: a
    metadata head count that does not match the tensors (a broken file)."""
    import gguf
    from gguf.quants import quantize

    from safetensors.torch import load_file

    types = (types or TINY_GGUF_TYPES) if quantized else {}
    suffix = "-".join(f"{k}={v}" for k, v in sorted(types.items())) if types != TINY_GGUF_TYPES else "quantized"
    out = Path(root) / (f"tiny-llama-{suffix}.gguf" if quantized else "tiny-llama.gguf")
    if kv_heads is not None:
        out = out.with_name(f"{out.stem}-kv-heads-{kv_heads}.gguf")
    if out.exists():
        return out
    model_dir = tiny_model_dir("llama", root)
    config = _config("llama")
    state = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(kv_heads or config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            stem, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[stem]}.{kind}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]  # fmt: skip
        array = tensor.float().numpy()
        kind = types.get(gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0])
        if kind is None or array.ndim not in (1, 2):
            writer.add_tensor(gguf_name, array)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        try:
            blocks = quantize(array, qtype)
        except (NotImplementedError, gguf.quants.QuantError):  # gguf-py writes no K-quants: random blocks with small fp16 scales
            values, size = gguf.GGML_QUANT_SIZES[qtype]
            rng = np.random.default_rng(len(gguf_name))
            blocks = rng.integers(0, 256, size=(array.size // values, size), dtype=np.uint8)
            for at in {"IQ4_NL": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[kind]:  # the fp16 scales
                blocks[:, at : at + 2] = (rng.standard_normal(blocks.shape[0]) * 0.002).astype(np.float16).view(np.uint8).reshape(-1, 2)
            blocks = blocks.reshape(array.shape[0], -1)
        writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
