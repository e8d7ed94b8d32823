"""``transfuse demo``: rewrite a model, show what changed, check it, time it against the original.

By default the model is a built-in small one, built from a configuration (random weights, no
download); ``--checkpoint`` takes a real one (a directory or a GGUF file) and its tokenizer. The
checks are real: greedy generation must be token-for-token identical before and after the
rewrite. The timing runs the original (a copy kept aside) and the rewritten forward in turn,
round after round, and prints the fastest, median and slowest of each; it claims a difference
only when the two ranges do not overlap. On a CPU the fused ops run their native PyTorch
definitions, so expect none there: the speed-ups come from the GPU kernels.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time

import torch

from .api import diff, report, rewrite
from .ops import current_platform
from .rewriter.apply import rewrites_of
from .presentation.diffview import summary

log = logging.getLogger("transfuse")

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
ROUNDS = 9
PROMPT = "The quick brown fox"


def _load(model_type: str | None, checkpoint: str | None, dtype: torch.dtype, **load_options):
    """(model, tokenizer or None, how to call it in the output); ``load_options``: ``load_model``'s
    ``trust_remote_code`` and ``allow_missing_weights``, for a checkpoint."""
    from .models import is_gguf, load_gguf, load_model, tiny_causal_lm

    if checkpoint is None:
        model_type = model_type or "llama"
        return tiny_causal_lm(model_type, dtype=dtype, **DEMO_SIZE), None, model_type
    if is_gguf(checkpoint):
        model, tokenizer = load_gguf(checkpoint, dtype=dtype, allow_missing_weights=load_options["allow_missing_weights"])
        return model, tokenizer, checkpoint
    from transformers import AutoTokenizer

    model = load_model(checkpoint, dtype=dtype, **load_options)
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer, checkpoint


def _interleaved_ms(first, second, rounds: int = ROUNDS) -> tuple[list[float], list[float]]:
    """Times of ``first`` and ``second`` run in turn, ``rounds`` times each, after one warm-up each."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return times


def run_demo(
    model_type: str | None = None,
    tokens: int = 128,
    new_tokens: int = 20,
    checkpoint: str | None = None,
    *,
    trust_remote_code: bool = False,
    allow_missing_weights: bool = False,
) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    options = {"trust_remote_code": trust_remote_code, "allow_missing_weights": allow_missing_weights}
    model, tokenizer, name = _load(model_type, checkpoint, dtype, **options)
    model = model.to(device).eval()
    size = sum(p.numel() for p in model.parameters()) / 1e6
    weights = "random weights" if checkpoint is None else "pretrained weights"
    print(f"model: {type(model).__name__} from {name}, {weights}, {size:.1f} M parameters, {dtype} on {device}")
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    if tokenizer is not None:
        prompt = tokenizer(PROMPT, return_tensors="pt").input_ids.to(device)
    else:
        prompt = ids[:, :8]
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    log.info("transfuse: generating %d tokens greedily with the original model", new_tokens)
    before = model.generate(prompt, **greedy)
    original = copy.deepcopy(model)

    rewrite(model)
    print()
    print(report(model))
    print()
    print(f"source changes ({len(diff(model).splitlines())} diff lines; `transfuse diff {name}` shows them):")
    for line in summary(rewrites_of(model)):
        print(f"  {line}")

    log.info("transfuse: generating %d tokens greedily with the rewritten model", new_tokens)
    after = model.generate(prompt, **greedy)
    same = torch.equal(before, after)
    print()
    print(f"greedy generation of {new_tokens} tokens: {'identical' if same else 'DIFFERENT'} before and after")
    if tokenizer is not None:
        print(f"  {tokenizer.decode(after[0], skip_special_tokens=True)!r}")

    def forward(m):
        def run():
            with torch.inference_mode():
                m(input_ids=ids)
            if device == "cuda":
                torch.cuda.synchronize()

        return run

    log.info("transfuse: timing the forward of %d tokens, %d rounds of each model in turn", tokens, ROUNDS)
    times = _interleaved_ms(forward(original), forward(model))
    print(f"forward of {tokens} tokens on {current_platform().name}, {ROUNDS} rounds in turn (fastest / median / slowest):")
    for label, ms in zip(("original ", "rewritten"), times):
        print(f"  {label}  {min(ms):8.2f} / {statistics.median(ms):8.2f} / {max(ms):8.2f} ms")
    (orig_min, orig_max), (new_min, new_max) = ((min(t), max(t)) for t in times)
    if new_max < orig_min or orig_max < new_min:
        ratio = statistics.median(times[0]) / statistics.median(times[1])
        print(f"  the rewritten forward is {ratio:.2f}x the original's speed (the ranges do not overlap)")
    else:
        print("  no difference measured: the ranges overlap")
        if device == "cpu":
            print("  (on a CPU the fused ops run their native PyTorch definitions: none is expected)")
    return 0 if same else 1
