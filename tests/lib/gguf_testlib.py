"""Tiny GGUF files in tests: the Llama metadata that every test writer shares."""
from typing import Any


def add_llama_header(writer: Any, cfg: Any, vocab_size: int) -> None:
    """An HF Llama config's hyperparameters as ``writer``'s (a ``gguf.GGUFWriter``) metadata,
    with RoPE base 10000 and a GPT-2 style BPE tokenizer to follow."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")


def add_weight(writer: Any, name: str, array: Any, qtype: Any) -> None:
    """A 2-D weight quantized to ``qtype`` (a ``gguf.GGMLQuantizationType``); anything else
    (the norms) as it is, in float32."""
    import gguf

    if array.ndim == 2:
        q = gguf.quants.quantize(array, qtype)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    else:
        writer.add_tensor(name, array)


def write_out(writer: Any) -> None:
    """Header, metadata and tensors to the file, in the order GGUF lays them out."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
