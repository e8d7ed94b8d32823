"""``transfuse demo``: rewrite a built-in small model, show what changed, check it, time it.

The model is built from a configuration (random weights, no download). The checks are
real: greedy generation must be token-for-token identical before and after the rewrite.
The timing compares the original and the rewritten forward on this machine; on a CPU the
fused ops run their native PyTorch definitions, so expect parity there: the speed-ups
come from the GPU kernels.
"""

from __future__ import annotations

import statistics
import time

import torch

from .api import diff, report, rewrite
from .ops import current_platform
from .rewriter.apply import rewrites_of
from .rewriter.diffview import summary
from .tiny import tiny_model

__all__ = ["run_demo"]

# Small, but large enough that a forward pass is not all Python overhead.
DEMO_SIZE = dict(
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=704,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=1024,
)


def _median_ms(fn, repeats: int = 7) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_demo(model_type: str | None = None, tokens: int = 128, new_tokens: int = 20) -> int:
    model_type = model_type or "llama"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model(model_type, dtype=dtype, **DEMO_SIZE).to(device)
    size = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {type(model).__name__}, random weights, {size:.1f} M parameters, {dtype} on {device}")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator).to(device)
    prompt = ids[:, :8]
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def forward():
        with torch.inference_mode():
            model(input_ids=ids)
        if device == "cuda":
            torch.cuda.synchronize()

    before_ms = _median_ms(forward)
    before = model.generate(prompt, **greedy)

    rewrite(model)
    print()
    print(report(model))
    print()
    print(f"source changes ({len(diff(model).splitlines())} diff lines; `transfuse diff {model_type}` shows them):")
    for line in summary(rewrites_of(model)):
        print(f"  {line}")

    after = model.generate(prompt, **greedy)
    after_ms = _median_ms(forward)
    same = torch.equal(before, after)
    print()
    print(f"greedy generation of {new_tokens} tokens: {'identical' if same else 'DIFFERENT'} before and after")
    print(f"forward of {tokens} tokens, median of 7 on {current_platform().name}:")
    print(f"  original   {before_ms:8.2f} ms")
    print(f"  rewritten  {after_ms:8.2f} ms  ({before_ms / after_ms:.2f}x)")
    if device == "cpu":
        print("  (on CPU the fused ops run their native PyTorch definitions: parity is expected here)")
    return 0 if same else 1
