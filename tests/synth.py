"""Tiny random-weight GGUF models written with the gguf writer.

Architectures: llama and qwen2 (what the method supports), qwen2vl (M-RoPE), mpt (ALiBi)
and mamba (recurrent memory, no KV cache), the last three to check that the native code
refuses them.

Dimensions are small so a test decodes in milliseconds; head_dim = 32 keeps every
head's K/V slice block-aligned for Q4_0/Q8_0 caches.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

SPECIALS = ["<unk>", "<s>", "</s>"]
PIECES = ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,?! ")


def _vocab():
    tokens, scores, types = [], [], []
    for i, s in enumerate(SPECIALS):
        tokens.append(s); scores.append(0.0); types.append(TokenType.UNKNOWN if i == 0 else TokenType.CONTROL)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>"); scores.append(0.0); types.append(TokenType.BYTE)
    for i, p in enumerate(PIECES):
        tokens.append(p); scores.append(-float(i)); types.append(TokenType.NORMAL)
    return tokens, scores, types


def write_model(path: Path, *, arch: str = "llama", n_layer: int = 2, n_head: int = 6, n_head_kv: int = 2,
                head_dim: int = 32, n_ff: int = 128, n_ctx_train: int = 4096, seed: int = 0) -> Path:
    """Write a random model; returns ``path``. Group ratio r = n_head / n_head_kv."""
    assert n_head % n_head_kv == 0
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    n_embd = n_head * head_dim

    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}-r{n_head // n_head_kv}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(0 if arch == "mamba" else n_head)
    w.add_head_count_kv(0 if arch == "mamba" else n_head_kv)
    if arch == "mamba":
        w.add_ssm_conv_kernel(4)
        w.add_ssm_inner_size(2 * n_embd)
        w.add_ssm_state_size(16)
        w.add_ssm_time_step_rank(8)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    if arch == "mpt":
        w.add_layer_norm_eps(1e-5)
        w.add_max_alibi_bias(8.0)
    else:
        w.add_layer_norm_rms_eps(1e-5)
    if arch == "qwen2vl":
        w.add_rope_dimension_sections([4, 6, 6, 0])
    w.add_file_type(0)  # all F32
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def t(name, *shape, scale=0.08):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", n_vocab, n_embd, scale=0.5)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    t("output.weight", n_vocab, n_embd, scale=0.2)
    if arch == "mamba":
        d_inner = 2 * n_embd
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
            t(p + "ssm_in.weight", 2 * d_inner, n_embd)
            t(p + "ssm_conv1d.weight", d_inner, 4)
            t(p + "ssm_conv1d.bias", d_inner)
            t(p + "ssm_x.weight", 8 + 2 * 16, d_inner)
            t(p + "ssm_dt.weight", d_inner, 8)
            t(p + "ssm_dt.bias", d_inner)
            w.add_tensor(p + "ssm_a", -np.exp(rng.standard_normal((d_inner, 16))).astype(np.float32))
            w.add_tensor(p + "ssm_d", np.ones(d_inner, dtype=np.float32))
            t(p + "ssm_out.weight", n_embd, d_inner)
        n_layer = 0
    if arch == "mpt":
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
            t(p + "attn_qkv.weight", n_embd + 2 * n_head_kv * head_dim, n_embd, scale=0.15)
            t(p + "attn_output.weight", n_embd, n_embd)
            w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
            t(p + "ffn_up.weight", n_ff, n_embd)
            t(p + "ffn_down.weight", n_embd, n_ff)
        n_layer = 0  # the llama-style loop below writes nothing more
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        t(p + "attn_q.weight", n_head * head_dim, n_embd, scale=0.15)
        t(p + "attn_k.weight", n_head_kv * head_dim, n_embd, scale=0.15)
        t(p + "attn_v.weight", n_head_kv * head_dim, n_embd, scale=0.15)
        if arch in ("qwen2", "qwen2vl"):
            t(p + "attn_q.bias", n_head * head_dim, scale=0.05)
            t(p + "attn_k.bias", n_head_kv * head_dim, scale=0.05)
            t(p + "attn_v.bias", n_head_kv * head_dim, scale=0.05)
        t(p + "attn_output.weight", n_embd, n_head * head_dim)
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        t(p + "ffn_gate.weight", n_ff, n_embd)
        t(p + "ffn_up.weight", n_ff, n_embd)
        t(p + "ffn_down.weight", n_embd, n_ff)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
