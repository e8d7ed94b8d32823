"""Training step time and peak memory: transformers, transfuse and Liger-Kernel side by side.

    python benchmarks/bench_train.py --out DIR                        # Llama-3-8B shapes and Qwen3-MoE shapes
    python benchmarks/bench_train.py --out DIR --models llama --variants transformers transfuse-lce
    python benchmarks/bench_train.py --out DIR --smoke                # toy sizes on the CPU: tests the script

Each variant builds the model from a config on the GPU in bf16 with random weights (the same seed
for all), then times forward + backward of one batch (``labels = input_ids``) over ``--steps``
steps after two warm-up steps, and, in the optimizer table, forward + backward + an AdamW step
(``fused=True`` on the GPU, the same for every variant).
Peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps (weights and gradients
included). Variants:

- ``transformers``: stock eager; ``transformers-compiled``: ``torch.compile(model)``;
- ``transfuse``: ``transfuse.rewrite`` with the default fusions; ``transfuse-lce``: plus the
  opt-in ``linear_cross_entropy``; ``transfuse-compiled`` and ``transfuse-lce-compiled``: the same
  under ``torch.compile`` (the table counts the graph breaks of compiled variants);
- ``liger``: ``apply_liger_kernel_to_<family>`` (its fused linear cross-entropy included), run in a
  process of its own, since it patches transformers' classes for the whole process;
- ``...-no-<kind>`` leaves one fusion kind out (``transfuse-lce-no-rotary``: what rotary is worth
  in the step); ``...-block<N>`` holds N MiB of logit gradients per block of the loss (default
  256: fewer, larger blocks mean fewer weight-gradient accumulations and a higher peak);
- ``--host VARIANT...``: the host's time to issue a step's forward and backward, and cProfile's
  functions by their own time (``host_<model>_<variant>.txt``): for steps bound by the host;
- ``--rounds N``: every variant N times, taking turns in the one process (step times are then the
  median of the rounds' medians, each round's in the table): host-bound steps move with the host;
- ``--gc off`` or ``--gc freeze``: the timed steps without Python's cyclic collector, or with
  everything alive before them frozen out of its reach (what the collector costs a step);
- ``*+peft``: the same with LoRA r=16 on q/k/v/o/gate/up/down (only the adapters train); on the
  dense model only (PEFT wraps packed experts too, which the fused MoE layer does not compute).

The FLOP floor counts the matmuls of a step (6 x parameters touched per token x tokens, 4 x for
frozen ones, the attention's scores and values causally) over the bf16 matmul rate measured in
the same run.
Writes ``DIR/bench_train.md`` and ``DIR/bench_train.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

MODELS = {
    "llama": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
        batch=4, seq=2048, liger="apply_liger_kernel_to_llama",
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        vocab_size=32000, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        tie_word_embeddings=False, batch=4, seq=1024, liger="apply_liger_kernel_to_qwen3_moe",
    ),
    # Whole models as users train them on one GPU: batch 1 x 4096 with activation checkpointing.
    "llama3_8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
        batch=1, seq=4096, liger="apply_liger_kernel_to_llama", checkpointing=True,
    ),
    "qwen3_30b": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=8192,
        tie_word_embeddings=False, batch=1, seq=4096, liger="apply_liger_kernel_to_qwen3_moe", checkpointing=True,
    ),
}  # fmt: skip
LAYERS = None  # --layers: fewer layers than the model has (as many as fit)
CHECKPOINT_CALLS = [0]  # activation-checkpoint calls (torch.utils.checkpoint.checkpoint through transformers)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, batch=2, seq=32)  # fmt: skip
VARIANTS = ["transformers", "transfuse", "transfuse-lce", "liger", "transformers-compiled", "transfuse-compiled",
            "transfuse-lce-compiled",
            "transformers+peft", "transfuse+peft", "liger+peft"]  # fmt: skip
GC_MODE = "on"  # --gc
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _all_kinds() -> list[str]:
    """Every default kind plus the opt-in loss (not a fixed list: a new default kind is measured too)."""
    from transfuse.fusers import default_kinds

    return [*default_kinds(), "linear_cross_entropy"]


def _config(name: str, smoke: bool):
    from transformers import AutoConfig

    spec = dict(MODELS[name])
    if smoke:
        spec.update({k: v for k, v in SMOKE.items() if k in spec or k in ("batch", "seq")})
    model_type, batch, seq = spec.pop("model_type"), spec.pop("batch"), spec.pop("seq")
    liger = spec.pop("liger")
    spec.pop("checkpointing", None)
    if LAYERS:
        spec["num_hidden_layers"] = LAYERS
    return AutoConfig.for_model(model_type, **spec), batch, seq, liger


def _enable_checkpointing(model) -> None:
    """``gradient_checkpointing_enable`` as a user calls it, with transformers' checkpoint function
    counted (the calls per step go in the table beside stock's)."""
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.checkpoint
    if not getattr(original, "_counted", False):
        def counted(*args, **kwargs):
            CHECKPOINT_CALLS[0] += 1
            return original(*args, **kwargs)

        counted._counted = True
        modeling_utils.checkpoint = counted
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _flops(model, config, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward + backward: per weight touched per token, 2 forward, 2 for the
    input's gradient and, if it trains, 2 for its own (frozen weights under LoRA: 4, not 6), plus
    causal attention (forward and both backward matmuls)."""
    tokens = batch * seq
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed" in name:
            continue
        touched = p[0].numel() * config.num_experts_per_tok if p.dim() == 3 else p.numel()  # packed experts: k of them
        total += (6 if p.requires_grad else 4) * touched * tokens
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = config.num_hidden_layers * 2 * 2 * batch * seq * seq * heads * head_dim / 2  # causal: half
    return total + 3 * attention


def _matmul_rate(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (start.elapsed_time(end) / 1000)


def _build(variant: str, name: str, smoke: bool, device: str):
    from transformers import AutoModelForCausalLM

    import transfuse

    config, batch, seq, liger = _config(name, smoke)
    if variant.startswith("liger"):
        import liger_kernel.transformers as liger_kernel

        getattr(liger_kernel, liger)()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    started = time.perf_counter()
    if variant.startswith("transfuse"):
        kinds = _all_kinds() if ("lce" in variant or "peft" in variant) else None
        left_out = re.findall(r"-no-(\w+)", variant)  # e.g. transfuse-lce-no-rotary: one kind's share
        if left_out:
            kinds = [k for k in (kinds or _all_kinds()[:-1]) if k not in left_out]
            if "rms_norm" in left_out and "add_rms_norm" in kinds:  # it builds on rms_norm
                kinds.remove("add_rms_norm")
        transfuse.rewrite(model, fusions=kinds)
    rewrite_s = time.perf_counter() - started
    if MODELS[name].get("checkpointing"):
        _enable_checkpointing(model)
    if variant.endswith("+peft"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0))
    model.train()
    if "compiled" in variant:
        model = torch.compile(model)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(1))
    return model, config, ids, rewrite_s


def _time_steps(model, ids, steps: int, optimizer, device: str) -> tuple[list[float], float, float]:
    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss

    for _ in range(2):
        step()
    if GC_MODE == "off":
        gc.disable()
    elif GC_MODE == "freeze":
        gc.collect()
        gc.freeze()
    try:
        return _timed(step, steps, device)
    finally:
        if GC_MODE == "off":
            gc.enable()
        elif GC_MODE == "freeze":
            gc.unfreeze()


def _timed(step, steps: int, device: str) -> tuple[list[float], float, float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return times, peak, float(loss.item())


def _profile(model, ids, rows: int = 50) -> str:
    """The GPU kernels of one step by total time, then the operators (with their input shapes)
    that launched them by their own GPU time: where the step goes, and which op a kernel is."""
    from torch.profiler import ProfilerActivity, profile

    paused = _paused_steps(model, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        _train_step(model, ids)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kernel = torch.autograd.profiler_util.EventList(kernels).table(
        sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70
    )
    by_op = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total", row_limit=2 * rows, max_name_column_width=50, max_shapes_column_width=90
    )
    return (
        f"GPU kernels\n{by_kernel}\n\nOperators by their own GPU time, with input shapes\n{by_op}\n\n"
        f"{_idle_gaps(prof.events())}\n\n{_runtime_calls(events)}\n\n{paused}"
    )


def _paused_steps(model, ids, steps: int = 3, pause_s: float = 1.0) -> str:
    """Steps each begun after ``pause_s`` of an idle GPU, against steps back to back: whether the
    timed steps' length beyond the profiled GPU span is the host's or the GPU's own (a GPU that
    rested runs its first milliseconds at higher clocks)."""
    times = {}
    for mode in ("back to back", f"after {pause_s:g} s idle"):
        torch.cuda.synchronize()
        taken = []
        for _ in range(steps):
            if mode != "back to back":
                time.sleep(pause_s)
            start = time.perf_counter()
            _train_step(model, ids)
            torch.cuda.synchronize()
            taken.append(1000 * (time.perf_counter() - start))
        times[mode] = taken
    return "Steps (ms): " + "; ".join(f"{mode}: {', '.join(f'{t:.2f}' for t in taken)}" for mode, taken in times.items())


def _idle_gaps(events, rows: int = 15) -> str:
    """Where the GPU waited: the step's span against the union of its kernels' intervals, and the
    longest gaps between consecutive kernels with the kernels on either side and the CPU
    operators that began during the gap (a host sync or slow launches shows up here)."""
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    if not kernels:
        return "No GPU kernels recorded."
    busy, gaps, end = 0.0, [], kernels[0].time_range.start
    for before, kernel in zip([None, *kernels], kernels):
        start, stop = kernel.time_range.start, kernel.time_range.end
        if start > end and before is not None:
            gaps.append((start - end, end, start, before.name, kernel.name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - kernels[0].time_range.start
    cpu_ops = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CPU), key=lambda e: e.time_range.start
    )
    syncs = [e for e in cpu_ops if e.name == "cudaDeviceSynchronize"]
    first_host = cpu_ops[0].time_range.start if cpu_ops else kernels[0].time_range.start
    sync_end = syncs[-1].time_range.end if syncs else end
    lines = [
        f"GPU busy {busy / 1000:.2f} ms of a {span / 1000:.2f} ms span from the first kernel to the last "
        f"({len(gaps)} gaps, {sum(g[0] for g in gaps) / 1000:.2f} ms idle); the first kernel began "
        f"{(kernels[0].time_range.start - first_host) / 1000:.2f} ms after the step's first host operator, and the "
        f"synchronisation returned {(sync_end - end) / 1000:.2f} ms after the last kernel ended",
        f"The {rows} longest gaps (us, the kernel before -> the kernel after; CPU operators begun in the gap):",
    ]
    for length, start, stop, before, after in sorted(gaps, reverse=True)[:rows]:
        begun = [e.name for e in cpu_ops if start <= e.time_range.start < stop and not e.name.startswith("cuda")]
        lines.append(f"  {length:8.1f}  {before[:50]} -> {after[:50]}; {', '.join(dict.fromkeys(begun))[:300]}")
    return "\n".join(lines)


def _runtime_calls(events) -> str:
    """CUDA runtime calls (synchronisations, copies, allocations, launches) by total CPU time."""
    calls = [e for e in events if e.key.startswith(("cuda", "aten::item", "aten::_local_scalar_dense"))]
    calls.sort(key=lambda e: e.cpu_time_total, reverse=True)
    lines = ["CUDA runtime calls and host reads of device values, by total CPU time (us, calls):"]
    lines += [f"  {e.cpu_time_total:10.1f}  {e.count:6d}  {e.key}" for e in calls[:15]]
    return "\n".join(lines)


def _host(model, ids, steps: int = 5, rows: int = 40) -> str:
    """Where the host's time goes in a step: the time to issue the forward and the backward (no
    synchronisation between them, so while the GPU has queued work this is the host's own cost)
    against the whole step, then cProfile's functions by their own time over ``steps`` steps. The
    backward runs on the calling thread (autograd's multithreading off), so its Python (autograd
    Functions' backward) is in the profile too."""
    import cProfile
    import io
    import pstats

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        issued = time.perf_counter()
        loss.backward()
        done = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return issued, done

    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    forward, backward, whole = [], [], []
    torch.autograd.set_multithreading_enabled(False)
    try:
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            issued, done = step()
            sync()
            forward.append(issued - start)
            backward.append(done - issued)
            whole.append(time.perf_counter() - start)
        profiler = cProfile.Profile()
        sync()
        profiler.enable()
        for _ in range(steps):
            step()
        sync()
        profiler.disable()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    forward_done = []
    with torch.no_grad():  # the forward alone, waited for: its GPU time when the host keeps ahead
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            model(input_ids=ids, labels=ids)
            sync()
            forward_done.append(time.perf_counter() - start)
    ms = lambda values: 1000 * statistics.median(values)  # noqa: E731
    text = io.StringIO()
    text.write(
        f"Host time to issue (median of {steps} steps, autograd on the calling thread): forward {ms(forward):.2f} ms, "
        f"backward {ms(backward):.2f} ms, the whole step with its synchronisation {ms(whole):.2f} ms; "
        f"the forward alone under no_grad, waited for: {ms(forward_done):.2f} ms\n\n"
        f"{_module_host_times(model, ids, steps)}\n\n{_op_host_times(model, ids, steps)}\n\n{_syncs(model, ids)}\n\n"
        f"cProfile over {steps} steps (cProfile slows Python itself: compare functions, not totals)\n"
    )
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def _train_step(model, ids) -> None:
    """Forward with labels, backward, gradients dropped: one step of the measurements below."""
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def _module_host_times(model, ids, steps: int, rows: int = 25) -> str:
    """Host time inside each module class's forward (inclusive of its children; hooks time each call
    with ``perf_counter``), per step, over ``steps`` training forwards: where the forward's host time goes."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    starts: dict[int, list[float]] = {}

    def before(module, args):
        starts.setdefault(id(module), []).append(time.perf_counter())

    def after(module, args, output):
        name = type(module).__name__
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - starts[id(module)].pop()
        counts[name] = counts.get(name, 0) + 1

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    try:
        for _ in range(steps):
            _train_step(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    lines = [f"Host time in each module class's forward, children included (ms per step, calls per step; {steps} steps):"]
    for name, total in sorted(totals.items(), key=lambda item: -item[1])[:rows]:
        lines.append(f"  {1000 * total / steps:8.3f}  {counts[name] // steps:4d}  {name}")
    return "\n".join(lines)


def _op_host_times(model, ids, steps: int) -> str:
    """Host time inside each dispatched transfuse op (``Op.__call__``: provider choice, autograd
    Function, the provider's Python, its launches) and inside each Triton launch, forward and
    backward, per step over ``steps`` training steps."""
    from transfuse.ops import dispatch
    from transfuse.ops.triton import launch

    totals: dict[str, list] = {}

    def timed(original, name_of):
        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                entry = totals.setdefault(name_of(self), [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        return wrapper

    call, launch_kernel = dispatch.Op.__call__, launch.Kernel.launch
    dispatch.Op.__call__ = timed(call, lambda op: f"op {op.name}")
    launch.Kernel.launch = timed(launch_kernel, lambda kernel: f"launch {kernel.fn.__name__}")
    try:
        for _ in range(steps):
            _train_step(model, ids)
    finally:
        dispatch.Op.__call__, launch.Kernel.launch = call, launch_kernel
    lines = ["Host time in each dispatched op and each Triton launch (ms per step, calls per step, us per call):"]
    for name, (total, count) in sorted(totals.items(), key=lambda item: -item[1][0]):
        lines.append(f"  {1000 * total / steps:8.3f}  {count // steps:4d}  {1e6 * total / count:8.1f}  {name}")
    return "\n".join(lines)


def _syncs(model, ids) -> str:
    """Every operation in one training step that makes the host wait for the GPU
    (``torch.cuda.set_sync_debug_mode``), with the Python stack that called it."""
    import traceback
    import warnings

    if not ids.is_cuda:
        return "Host waits: not measured on the CPU."
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        found.append(f"{message}\n" + "".join(traceback.format_stack(limit=10)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _train_step(model, ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if not found:
        return "Host waits for the GPU in one step (set_sync_debug_mode): none."
    return f"Host waits for the GPU in one step (set_sync_debug_mode): {len(found)}\n" + "\n".join(found[:10])


def _block_mib(variant: str) -> int | None:
    """``-block<N>``: the loss's blocks of logit gradients hold N MiB (default ``BLOCK_BYTES``)."""
    found = re.search(r"-block(\d+)", variant)
    return int(found.group(1)) if found else None


def run_variant(
    variant: str, name: str, steps: int, smoke: bool, device: str, profile: tuple = (), host: tuple = ()
) -> dict:
    lce = importlib.import_module("transfuse.ops.linear_cross_entropy")  # the module, not the function
    result = {"variant": variant, "model": name}
    default_block, block_mib = lce.BLOCK_BYTES, _block_mib(variant)
    if block_mib:
        lce.BLOCK_BYTES = block_mib << 20
    try:
        model, config, ids, rewrite_s = _build(variant, name, smoke, device)
        result["rewrite_s"] = rewrite_s
        if variant.startswith("transfuse"):
            import transfuse

            base = model.base_model.model if variant.endswith("+peft") else model
            result["fusions"] = transfuse.report(getattr(base, "_orig_mod", base)).counts()
            # No second name for the model: ``del model`` below must free it (a rewritten model
            # is in reference cycles, so a name left here kept its weights, 3.6 GiB at these
            # shapes, alive into the next variant's peak until the collector ran).
            del base
        result["flops"] = _flops(getattr(model, "_orig_mod", model), config, *ids.shape)
        started = time.perf_counter()
        if "compiled" in variant:
            torch._dynamo.utils.counters.clear()
        CHECKPOINT_CALLS[0] = 0
        times, peak, loss = _time_steps(model, ids, steps, None, device)
        if MODELS[name].get("checkpointing"):
            result["checkpoint_calls_per_step"] = CHECKPOINT_CALLS[0] / (steps + 2)
        if "compiled" in variant:
            result["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        result.update(step_ms=1000 * statistics.median(times), step_min_ms=1000 * min(times), peak_gib=peak, loss=loss)
        result["first_steps_s"] = time.perf_counter() - started - sum(times)
        if variant in profile and device == "cuda":
            result["profile"] = _profile(model, ids)
        if variant in host:
            result["host"] = _host(model, ids)
        # The fused step on the GPU (one kernel per tensor group, no temporaries the size of the
        # weights, which a whole 8B model's foreach step would need on top of its states).
        fused = {"fused": True} if device == "cuda" else {"foreach": True}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, **fused)
        times, peak, _ = _time_steps(model, ids, steps, optimizer, device)
        result.update(adamw_step_ms=1000 * statistics.median(times), adamw_peak_gib=peak)
        result["tokens_per_s"] = ids.numel() / (result["step_ms"] / 1000)
        del model, optimizer
    except Exception as exc:  # a variant that fails is reported, the others still run
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        lce.BLOCK_BYTES = default_block
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _in_own_process(variant: str, name: str, args) -> dict:
    command = [sys.executable, __file__, "--only", variant, "--models", name, "--steps", str(args.steps)]
    if args.layers:
        command += ["--layers", str(args.layers)]
    if args.smoke:
        command.append("--smoke")
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"variant": variant, "model": name, "error": (done.stderr or done.stdout)[-500:]}
    return json.loads(lines[-1])


def _merge_rounds(runs: list[dict]) -> dict:
    """One row of a variant's rounds: the first round's row with the median of the rounds' step
    times (and each round's, in ``round_ms``)."""
    merged = dict(runs[0])
    done = [r for r in runs if "error" not in r]
    if len(runs) > 1 and done:
        for key in ("step_ms", "adamw_step_ms", "tokens_per_s"):
            merged[key] = statistics.median(r[key] for r in done)
        merged["round_ms"] = [round(r["step_ms"], 2) for r in done]
    return merged


def _table(results: list[dict], rate: float) -> list[str]:
    lines = [
        "| model | variant | step ms | tokens/s | vs transformers | FLOP floor ms | peak GiB | + AdamW ms | AdamW peak GiB | loss | fusions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    base = {(r["model"], r["variant"].endswith("+peft")): r for r in results if r["variant"].startswith("transformers") and "compiled" not in r["variant"] and "error" not in r}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | failed: {r['error'][:200]} |")
            continue
        ref = base.get((r["model"], r["variant"].endswith("+peft")))
        speedup = f"{ref['step_ms'] / r['step_ms']:.2f}x" if ref else ""
        floor = f"{1000 * r['flops'] / rate:.1f}" if rate else ""
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {speedup} | {floor} | "
            f"{r['peak_gib']:.2f} | {r['adamw_step_ms']:.1f} | {r['adamw_peak_gib']:.2f} | {r['loss']:.4f} | "
            f"{r.get('fusions', '')}{' graph breaks: %d' % r['graph_breaks'] if 'graph_breaks' in r else ''}"
            f"{' rounds: ' + ', '.join(map(str, r['round_ms'])) if 'round_ms' in r else ''}"
            f"{' checkpoint calls per step: %g' % r['checkpoint_calls_per_step'] if 'checkpoint_calls_per_step' in r else ''} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=VARIANTS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (the liger variants are skipped)")
    parser.add_argument("--profile", nargs="*", default=[], help="variants whose step's GPU kernels to list")
    parser.add_argument("--host", nargs="*", default=[], help="variants whose host time to break down (cProfile)")
    parser.add_argument("--rounds", type=int, default=1, help="times each variant runs, taking turns (the median is kept)")
    parser.add_argument(
        "--gc", choices=["on", "off", "freeze"], default="on",
        help="Python's cyclic collector during the timed steps: on (as a user runs), off, or freeze (everything "
        "alive after the model is built moved out of its reach, as gc.freeze() does): what it costs a host-bound step",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (as many as fit)")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one variant, in this process (Liger's own process)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    global GC_MODE, LAYERS
    GC_MODE, LAYERS = args.gc, args.layers
    if args.only:
        print(json.dumps(run_variant(args.only, args.models[0], args.steps, args.smoke, device)))
        return 0
    rate = 0.0 if args.smoke else _matmul_rate(device)
    results = []
    for name in args.models:
        rounds: dict[str, list[dict]] = {}
        for index in range(args.rounds):  # the variants take turns, so a slow spell of the host hits all
            for variant in args.variants:
                if (variant.startswith("liger") and args.smoke) or (variant.endswith("+peft") and name != "llama"):
                    continue
                if variant.startswith("liger"):
                    result = _in_own_process(variant, name, args)
                else:
                    profile, host = (tuple(args.profile), tuple(args.host)) if index == 0 else ((), ())
                    result = run_variant(variant, name, args.steps, args.smoke, device, profile, host)
                rounds.setdefault(variant, []).append(result)
                print(json.dumps(result), flush=True)
        results += [_merge_rounds(runs) for runs in rounds.values()]
    lines = [
        "`python " + " ".join(sys.argv) + "`",
        "",
        f"torch {torch.__version__}, transformers {importlib.import_module('transformers').__version__}" + (f", {torch.cuda.get_device_name()}, bf16 matmul {rate / 1e12:.0f} TFLOP/s "
                                          "(8192^3, this run)" if rate else ", CPU smoke run"),
        "",
        *_table(results, rate),
    ]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for r in results:
            for part in ("profile", "host"):
                if part in r:
                    name = f"{part}_{r['model']}_{r['variant'].replace('+', '_')}.txt"
                    with open(os.path.join(args.out, name), "w") as f:
                        f.write(r.pop(part))
        with open(os.path.join(args.out, "bench_train.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "bench_train.json"), "w") as f:
            json.dump({"command": " ".join(sys.argv), "matmul_flops": rate, "results": results}, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
