"""How long rewrite() takes on a 32-layer model with Llama-3-8B's shapes, built on the meta device."""

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import transfuse

config = AutoConfig.for_model(
    "llama",
    num_hidden_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
start = time.perf_counter()
transfuse.rewrite(model)
print(f"rewrite of a 32-layer model on the meta device: {time.perf_counter() - start:.2f} s")
print(transfuse.report(model))
