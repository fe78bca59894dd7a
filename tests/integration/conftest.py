"""A tiny random Llama and two PEFT adapters (q, k, v, o) saved to disk, shared by the
integration tests so they go through the real loaders."""
import pytest
import torch

VOCAB = 96


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("tiny")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(root / "model")
    adapters = {}
    for i, name in enumerate(("planner", "critic")):
        torch.manual_seed(10 + i)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"),
                              LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        peft.save_pretrained(root / name)
        adapters[name] = root / name
    return root / "model", adapters


