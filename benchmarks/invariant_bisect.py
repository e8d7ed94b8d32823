"""The first operation of a compiled batch-invariant model whose row differs alone and in a batch.

    python benchmarks/invariant_bisect.py --out DIR [--layers 2] [--batch 7]
    python benchmarks/invariant_bisect.py --tiny --out DIR     # on a CPU, tiny shapes

A model of Llama-3-8B layer shapes (``--layers`` layers, bf16 random weights) is rewritten in
batch-invariant mode and compiled (``transfuse.compile(..., cuda_graphs=False, replay=False)``,
so every call runs where it can be watched; ``--inductor off`` leaves the pieces as traced). One
prompt's prefill runs alone and as row ``at`` of a left-padded batch of ``--batch`` prompts. Every
call of a dispatched op (at run time, outside Dynamo), of the compile path's attention op and of
each piece Inductor compiled is recorded with copies of its inputs and outputs; the two runs'
records are paired by kind, name and occurrence, the prompt's row (the last ``length`` positions
of row ``at``) is cut from the batch's tensors, and each pair says whether its inputs and its
outputs are bit-identical. The first pair with equal inputs and different outputs is the
operation that depends on the batch. Writes DIR/invariant_bisect.md and .json.

``--across``: instead, the prompt alone through the eager model and through the compiled one (both
in the mode), the dispatched ops of the two paired by name and occurrence: the first op whose
inputs are the same bits and whose outputs are not, or the first whose inputs already differ (the
difference arose in the model's own code before it).

``--across --steps N``: the prompt alone decoded ``N`` greedy tokens eagerly and through the decode
steps (``transfuse.decode_steps``), whose steps go through a key/value store; the steps are run
without CUDA graphs so that their ops can be recorded and paired as above, and once more with
graphs, whose logits are compared with the other two runs' step by step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transfuse  # noqa: E402
from bench_batch_invariant import left_padded, random_prompts  # noqa: E402
from bench_decode import build  # noqa: E402

# (kind, name, inputs, outputs[, a piece's code]): pieces are paired by occurrence alone (their
# code names the shapes it was compiled for).
RECORDS: list[tuple] = []
ON = [False]
# (op, provider chosen, whether a CUDA graph was being captured) of each dispatched call while ``ON``.
CHOICES: list[tuple[str, str, bool]] = []


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _tensors(value) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _copies(value) -> list[torch.Tensor]:
    # Weights are kept by reference (they do not change): copies of every weight a step reads
    # would fill the GPU.
    return [t if isinstance(t, torch.nn.Parameter) else t.detach().clone() for t in _tensors(value)]


def _watch() -> None:
    """Record dispatched ops, the attention op and Inductor's pieces while ``ON``."""
    import torch._inductor.compile_fx as inductor

    import transfuse.compile.attention as attention
    from transfuse.ops import dispatch

    call, chosen = dispatch.Op.__call__, dispatch.Op._chosen

    def op_call(self, *args, **kwargs):
        if not ON[0] or torch.compiler.is_compiling() or _capturing():
            return call(self, *args, **kwargs)
        inputs = _copies((args, kwargs))
        out = call(self, *args, **kwargs)
        RECORDS.append(("op", self.name, inputs, _copies(out)))
        return out

    def watched_choice(self, args, kwargs):
        grad, provider = chosen(self, args, kwargs)
        if ON[0]:
            CHOICES.append((self.name, provider.name, _capturing()))
        return grad, provider

    dispatch.Op.__call__ = op_call
    dispatch.Op._chosen = watched_choice
    attend = attention.cached_attention

    def cached_attention(*args, **kwargs):
        inputs = _copies((args, kwargs)) if ON[0] else None
        out = attend(*args, **kwargs)
        if ON[0]:
            RECORDS.append(("attention", f"layer {args[4]}", inputs, _copies(out)))
        return out

    attention.cached_attention = cached_attention
    compile_fx = inductor.compile_fx

    def watched_compile(piece, inputs, *rest, **kwargs):
        compiled = compile_fx(piece, inputs, *rest, **kwargs)
        code = piece.code

        def run(*args):
            copies = _copies(args) if ON[0] else None
            out = compiled(*args)
            if ON[0]:
                RECORDS.append(("piece", "", copies, _copies(out), code))
            return out

        return run

    inductor.compile_fx = watched_compile


def _row(a: torch.Tensor, b: torch.Tensor, at: int, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``a`` (alone) and the prompt's part of ``b`` (the batch), or None where they cannot be paired."""
    if a.shape == b.shape:
        return a, b
    if a.dim() != b.dim() or a.dim() == 0:
        return None
    if a.shape[0] == 1 and b.shape[0] == batch:
        b = b[at : at + 1]
    elif b.shape[0] % batch == 0 and b.shape[0] // batch >= a.shape[0]:
        b = b.reshape(batch, b.shape[0] // batch, *b.shape[1:])[at]
        b = b.narrow(0, b.shape[0] - a.shape[0], a.shape[0])
    for d in range(1, a.dim()):
        if a.shape[d] < b.shape[d]:
            b = b.narrow(d, b.shape[d] - a.shape[d], a.shape[d])
    return (a, b) if a.shape == b.shape else None


def _same(alone: list[torch.Tensor], batched: list[torch.Tensor], at: int, batch: int) -> tuple[bool | None, float]:
    """(all pairable tensors bit-identical, or None where none could be paired; largest difference)."""
    verdict, largest = None, 0.0
    for a, b in zip(alone, batched):
        pair = _row(a, b, at, batch)
        if pair is None:
            continue
        x, y = pair
        equal = torch.equal(x, y)
        verdict = equal if verdict is None else (verdict and equal)
        if not equal and x.is_floating_point():
            largest = max(largest, float((x.float() - y.float()).abs().nan_to_num(posinf=1e30).max()))
    return verdict, largest


def _prefill(model, prompts) -> list:
    ids, mask = left_padded(prompts)
    RECORDS.clear()
    ON[0] = True
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))  # as generate gives them
    finally:
        ON[0] = False
    return list(RECORDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=7)
    parser.add_argument("--inductor", choices=("on", "off"), default="on")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--show", type=int, default=60, help="pairs listed in the table")
    parser.add_argument("--across", action="store_true", help="eager against compiled, the prompt alone")
    parser.add_argument("--steps", type=int, default=0, help="with --across: eager against the decode steps, N tokens")
    args = parser.parse_args(argv)
    _watch()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    model = build("tiny" if args.tiny else "llama", device, num_hidden_layers=args.layers)
    vocab = model.config.vocab_size
    lengths = (3, 9) if args.tiny else (16, 120)
    target = random_prompts(1, vocab, lengths, device, seed=1)[0]
    others = random_prompts(args.batch - 1, vocab, (lengths[1], lengths[1] + 8), device, seed=2)
    at = args.batch // 2
    batch = others[:at] + [target] + others[at:]
    transfuse.rewrite(model, batch_invariant=True)
    eager = copy.deepcopy(model) if args.across else None
    if args.across and args.steps:
        return _across(eager, _with_steps(model), target, args, device)
    transfuse.compile(model, batch_invariant=True, cache_dir=False, cuda_graphs=False, replay=False,
                      inductor=args.inductor == "on")  # fmt: skip
    if args.across:
        return _across(eager, model, target, args, device)
    for _ in range(2):  # compiled for both shapes before anything is recorded
        _prefill(model, [target])
        _prefill(model, batch)
    alone, batched = _prefill(model, [target]), _prefill(model, batch)

    seen: dict[tuple[str, str], int] = {}
    index: dict[tuple[str, str, int], tuple] = {}
    for kind, name, inputs, outputs, *_ in batched:
        n = seen.get((kind, name), 0)
        seen[(kind, name)] = n + 1
        index[(kind, name, n)] = (inputs, outputs)
    seen.clear()
    pairs = []
    for kind, name, inputs, outputs, *code in alone:
        n = seen.get((kind, name), 0)
        seen[(kind, name)] = n + 1
        other = index.get((kind, name, n))
        if other is None:
            pairs.append({"kind": kind, "name": name, "n": n, "paired": False, "code": code[0] if code else None})
            continue
        ins, _ = _same(inputs, other[0], at, args.batch)
        outs, largest = _same(outputs, other[1], at, args.batch)
        pairs.append({"kind": kind, "name": name, "n": n, "paired": True, "inputs equal": ins,
                      "outputs equal": outs, "largest": largest, "code": code[0] if code else None})  # fmt: skip
    culprit = next((p for p in pairs if p.get("inputs equal") is not False and p.get("outputs equal") is False), None)
    result = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "records alone": len(alone), "records batched": len(batched), "first differing": culprit,
              "logits equal": pairs[-1] if pairs else None, "pairs": pairs}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "invariant_bisect.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"Command: `python benchmarks/invariant_bisect.py {' '.join(sys.argv[1:])}` ({result['device']})", "",
             f"Records: {len(alone)} alone, {len(batched)} in the batch. First operation with equal inputs and "
             f"different outputs: {'none' if culprit is None else culprit['kind'] + ' ' + culprit['name'] + ' #' + str(culprit['n'])!r}.", "",
             "| # | kind | name | inputs equal | outputs equal | largest |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for i, p in enumerate(pairs[: args.show]):
        name = f"#{p['n']}" if p["kind"] == "piece" else p["name"]
        lines.append(f"| {i} | {p['kind']} | {name} | {p.get('inputs equal')} | {p.get('outputs equal')} | "
                     f"{p.get('largest', 0):.3g} |")  # fmt: skip
    if culprit is not None and culprit["kind"] == "piece":
        lines += ["", "The first differing piece, as compiled for the prompt alone:", "", "```", culprit["code"].strip(), "```"]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "invariant_bisect.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


def _with_steps(model):
    """``model`` given decode steps, whose steps go through the store without CUDA graphs while
    ``UNCAPTURED[0]`` (so that every op they dispatch runs where it can be recorded)."""
    from transfuse.compile import eager_steps, replay

    transfuse.decode_steps(model)
    init, replayed = eager_steps.EagerSteps.__init__, replay.CallGraphs.__call__

    def with_store(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.options["kv_store"] = True

    def uncaptured(self, run, store, kwargs, *rest):
        return run(kwargs) if UNCAPTURED[0] else replayed(self, run, store, kwargs, *rest)

    eager_steps.EagerSteps.__init__ = with_store
    replay.CallGraphs.__call__ = uncaptured
    if next(model.parameters()).device.type != "cuda":  # a dry run on a CPU: the store without graphs there
        admission = eager_steps._admission

        def on_cpu(each):
            why, configs = admission(each)
            if why == "the model's weights are not all on one CUDA device":
                return None, eager_steps.check(each)
            return why, configs

        eager_steps._admission = on_cpu
    return model


UNCAPTURED = [True]


def _decode(model, target, new: int) -> tuple[list, torch.Tensor]:
    """The ops recorded while ``model`` decodes ``target`` alone ``new`` greedy tokens, and the logits of each step."""
    RECORDS.clear()
    CHOICES.clear()
    ON[0] = True
    try:
        with torch.no_grad():
            out = model.generate(
                target[None], attention_mask=torch.ones_like(target[None]), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
    finally:
        ON[0] = False
    return list(RECORDS), torch.stack(out.logits, dim=1)[0]


def _across(eager, compiled, target, args, device: str) -> int:
    """The prompt alone through both paths; their dispatched ops paired by name and occurrence."""
    records = {}
    logits = {}
    if args.steps:
        choices = {}
        for path, label, model in (("eager", "eager", eager), ("compiled", "steps", compiled)):
            found, logits[label] = _decode(model, target, args.steps)
            records[path] = [r for r in found if r[0] == "op"]
            choices[label] = sorted({(op, provider) for op, provider, _ in CHOICES})
        from transfuse.compile import eager_steps

        UNCAPTURED[0] = False
        _, logits["steps captured"] = _decode(compiled, target, args.steps)
        choices["steps captured, under capture"] = sorted({(op, p) for op, p, capturing in CHOICES if capturing})
        for label, found in choices.items():
            print(f"providers, {label}:", ", ".join(f"{op} {provider}" for op, provider in found))
        logits_report = {
            f"{a} / {b}": {
                "identical per step": (logits[a] == logits[b]).all(-1).tolist(),
                "largest per step": (logits[a].float() - logits[b].float()).abs().amax(-1).tolist(),
            }
            for a, b in (("eager", "steps"), ("eager", "steps captured"), ("steps", "steps captured"))
        }
        logits_report["steps path"] = eager_steps.stats(compiled)
        logits_report["providers"] = choices
        for name, entry in logits_report.items():
            if name == "providers":
                continue
            print(name, entry if name == "steps path" else
                  f"identical at steps {[i for i, same in enumerate(entry['identical per step']) if same]} of {args.steps}, "
                  f"largest difference {max(entry['largest per step']):.3g}")  # fmt: skip
    else:
        for _ in range(2):
            _prefill(compiled, [target])
        for path, model in (("eager", eager), ("compiled", compiled)):
            records[path] = [r for r in _prefill(model, [target]) if r[0] == "op"]
    seen: dict[str, int] = {}
    index = {}
    for _, name, inputs, outputs, *_ in records["compiled"]:
        n = seen.get(name, 0)
        seen[name] = n + 1
        index[(name, n)] = (inputs, outputs)
    seen.clear()
    pairs = []
    for _, name, inputs, outputs, *_ in records["eager"]:
        n = seen.get(name, 0)
        seen[name] = n + 1
        other = index.get((name, n))
        if other is None:
            pairs.append({"name": name, "n": n, "paired": False})
            continue
        if len(inputs) != len(other[0]):
            pairs.append({"name": name, "n": n, "paired": False, "inputs": (len(inputs), len(other[0]))})
            continue
        ins, _ = _same(inputs, other[0], 0, 1)
        outs, largest = _same(outputs, other[1], 0, 1)
        each = [  # every input tensor: (shape, dtype, stride eager, stride compiled, equal, largest difference)
            (list(a.shape), str(a.dtype), a.stride(), b.stride(), *_same([a], [b], 0, 1)) for a, b in zip(inputs, other[0])
        ]
        pairs.append({"name": name, "n": n, "paired": True, "inputs equal": ins, "outputs equal": outs,
                      "largest": largest, "each input": each})  # fmt: skip
    culprit = next((p for p in pairs if p.get("inputs equal") is False or p.get("outputs equal") is False), None)
    result = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "ops eager": len(records["eager"]), "ops compiled": len(records["compiled"]),
              "first differing": culprit, "pairs": pairs}  # fmt: skip
    if args.steps:
        result["logits"] = logits_report
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "invariant_bisect_across.json"), "w") as f:
        json.dump(result, f, indent=1)
    if culprit is not None and culprit.get("inputs equal") is False:
        print("inputs of the first differing op (shape, dtype, strides eager / compiled, equal, largest):")
        for entry in culprit["each input"]:
            print("   ", entry)
    if culprit is None:
        verdict = "none: every paired op had the same inputs and outputs"
    elif culprit.get("inputs equal") is False:
        verdict = f"{culprit['name']} #{culprit['n']} received other inputs (the model's own code before it differs)"
    else:
        verdict = f"{culprit['name']} #{culprit['n']} gave other outputs from the same inputs"
    lines = [f"Command: `python benchmarks/invariant_bisect.py {' '.join(sys.argv[1:])}` ({result['device']})", "",
             f"Dispatched ops: {len(records['eager'])} eager, {len(records['compiled'])} {'decode steps' if args.steps else 'compiled'}. "
             f"First difference: {verdict}.",
             "", "| # | op | paired | inputs equal | outputs equal | largest |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for i, p in enumerate(pairs[: args.show]):
        lines.append(f"| {i} | {p['name']} #{p['n']} | {p['paired']} | {p.get('inputs equal')} | "
                     f"{p.get('outputs equal')} | {p.get('largest', 0):.3g} |")  # fmt: skip
    text = "\n".join(lines)
    with open(os.path.join(args.out, "invariant_bisect_across.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
