"""Coverage of every causal LM in transformers: what transfuse fuses, refuses, and whether it is exact.

    python benchmarks/coverage.py --out DIR                  # every type, in parallel subprocesses
    python benchmarks/coverage.py --out DIR --types llama qwen3_moe
    python benchmarks/coverage.py --one llama                # one type, a JSON line (what the workers run)

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: build the tiny random model
(``transfuse.tiny``, float32, CPU), count the fusion opportunities *by structure* (the heuristics
below, which know nothing of transfuse's fusers), rewrite a copy with the default fusions, and
compare the copy with the stock model: logits on random token ids (a wrong answer: a difference
beyond 1e-5 of the logits' scale) and 8 greedy tokens of ``generate`` (a wrong answer: any token
different). Writes ``DIR/COVERAGE.md`` (a summary line, the totals per kind, one row per type) and
``DIR/coverage.json``.

Opportunities, counted per module instance while the stock model runs once:

- ``rms_norm``: a module whose class name contains ``rmsnorm`` (any case; not one that holds such a
  module, a gated wrapper of its norm: the child is counted), a leaf module with a
  single 1-D ``weight`` whose forward source reads ``rsqrt`` and subtracts no mean (cohere's
  LayerNorm without a bias subtracts one: the root of a variance), or a leaf module with no parameters
  whose class source reads ``rsqrt`` and a ``mean`` (llama4's "L2" norm is a root mean square;
  dory's, a plain sum of squares, is not counted);
- ``gate_up``: two ``nn.Linear`` children of one module called on the same tensor whose outputs
  feed another child of that module as ``act(one) * other``, or are the module's own output so
  (checked on the values, for silu, gelu, gelu-tanh, relu, squared relu and sigmoid; the child is
  the down projection, or a norm before it as in bitnet; a module computing the gated product
  alone, with the down projection in its parent, returns it): a GLU;
- ``qkv``: any other set of two or more ``nn.Linear`` children of one module called on the same
  tensor (q, k and v; with a gate; k and v of cross-attention; MLA's low-rank pair; the input
  projections of linear-attention blocks): what an n-way merge could fuse;
- ``moe``: a module with a child named ``experts`` or a child whose class name ends with ``Experts``
  (granitemoe's ``ParallelExperts`` children), itself not such a class, that the forward calls; one
  whose ``experts`` child is itself such a module is not counted apart (one mixture, counted once, at
  the module holding the experts). A module holding experts that the model never calls computes no
  block of its own: another module calls its methods piecewise (jetmoe's mixture of attention heads:
  the chosen experts' query projections in ``map``, attention over the sequence, then their output
  projections and the weighted sum in ``reduce``), which is attention with routed projections, not a
  block of expert MLPs that a fused mixture of experts could take the place of. Such a module is not
  counted here; ``transfuse.census`` still counts its experts, so it must be refused with a tag.

"Fused" counts the report's fusions per kind, and a GLU of an expert in the experts of a fused
mixture (the fused op computes it: its gate/up projection, activation and product); "complete" is a type where every opportunity was
fused. Every counted opportunity must also be accounted for by the report: a fusion at its module
(of its kind, or of the other projection kind: a GLU pair merged as an n-way projection; for a
mixture, at the module or its ``experts`` child), or a refusal of its kind for that module or its
class; one neither fused nor refused is "silent" (the table lists them, and the CI subset fails on
any). A module's class is the one it had when the model was built, the one the rewrite saw: a stock
forward that replaces a module of the model with one of another class (big_bird's block-sparse
attention becomes full attention on short inputs) is listed in its row ("replaced by its forward"),
the new module runs as written in the rewritten model too, and its opportunities are accounted
under the class that was rewritten. A crash is an exception from ``transfuse.rewrite`` or from the rewritten model where the
stock one ran (a refusal is not one), or a worker that died otherwise or ran past ``--timeout``;
a worker the kernel killed for memory is counted apart (some composite configurations keep
full-size sub-models: the table gives their parameter count).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

KINDS = ("rms_norm", "qkv", "gate_up", "moe", "rotary")
TOLERANCE = 1e-5
NEW_TOKENS = 8

# A fixed subset for CI (tests/test_coverage.py): dense, MoE, MLA (with DeepSeek-V3.2's indexer), gated,
# linear-attention, partial-rotary and shared self/cross-attention families.
CI_TYPES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere",
    "granite", "starcoder2", "stablelm", "glm", "helium", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe",
    "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "granitemoe", "jetmoe", "dbrx", "phimoe", "gpt2",
    "opt", "falcon", "bart", "qwen3_next", "deepseek_v32", "axk2", "gptj",
]  # fmt: skip


def _rms_norm_like(module) -> bool:
    name = type(module).__name__.lower()
    if "rmsnorm" in name:
        # (unless a wrapper of one: a gated norm whose child is the norm, counted there)
        return not any(_rms_norm_like(child) for child in module.children())
    params = dict(module.named_parameters(recurse=False))
    weighted = set(params) == {"weight"} and params["weight"].dim() == 1
    if not (weighted or not params) or list(module.children()):
        return False
    try:
        if weighted:
            forward = inspect.getsource(type(module).forward)
            return "rsqrt" in forward and not _subtracts_a_mean(forward)
        source = inspect.getsource(type(module))
    except (OSError, TypeError):
        return False
    return "rsqrt" in source and ".mean(" in source


def _subtracts_a_mean(source: str) -> bool:
    """The forward subtracts a mean from a value (``x - x.mean(...)``, or a name assigned one): a
    LayerNorm without a bias (cohere's), whose root is that of a variance, not of a mean square."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False

    def mean_call(node):
        return any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "mean" for n in ast.walk(node))

    means = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and mean_call(n.value) for t in n.targets if isinstance(t, ast.Name)}
    subtractions = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)]
    return any(mean_call(s.right) or (isinstance(s.right, ast.Name) and s.right.id in means) for s in subtractions)


OUTPUT = "<output>"  # in ``read``: a module's own output, beside its children's inputs


def _feeds_a_glu(path: str, pair: list[str], seen: dict, read: dict) -> bool:
    """Another child of the same module (``read``: its first input), or the module's own output
    (``read`` under ``OUTPUT``), is ``act(one) * other`` of the pair's outputs (a GLU)."""
    import torch
    import torch.nn.functional as F

    acts = (F.silu, F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.relu, lambda t: F.relu(t).square(), torch.sigmoid)
    a, b = (seen[(path, name)][1] for name in pair)
    for (parent, name), x in read.items():
        if parent != path or name in pair or x.shape != a.shape or a.shape != b.shape:
            continue
        for act in acts:
            for gate, up in ((a, b), (b, a)):
                if torch.allclose(act(gate) * up, x, rtol=1e-4, atol=1e-5):
                    return True
    return False


def count_opportunities(model, ids) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Opportunities per kind in one forward of the stock model, and the modules counted."""
    import torch
    from torch import nn

    where: dict[str, list[str]] = defaultdict(list)
    mixtures = {}
    for path, module in model.named_modules():
        if _rms_norm_like(module):
            where["rms_norm"].append(path)
        children = dict(module.named_children())
        if "experts" in children or any(type(c).__name__.endswith("Experts") for c in children.values()):
            if not type(module).__name__.endswith("Experts"):
                mixtures[path] = module
    # One mixture, one opportunity: a module whose ``experts`` child is itself counted is not another.
    mixtures = {p: m for p, m in mixtures.items() if (f"{p}.experts" if p else "experts") not in mixtures}
    called = set()
    # Linears called on the same tensor, per parent module and call.
    parent_of = {}
    for path, module in model.named_modules():
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                parent_of[child] = (path, module, name)
    calls: dict[tuple[str, int], set[str]] = defaultdict(set)
    inputs = []  # kept alive through the forward, so that no two inputs share an id
    seen: dict[tuple[str, str], tuple] = {}  # (parent, linear) -> (input, output) of its first call
    read: dict[tuple[str, str], object] = {}  # (parent, child) -> first input, for parents of linears
    readers = {
        child: (path, name)
        for path, module in model.named_modules()
        if any(isinstance(c, nn.Linear) for c in module.children())
        for name, child in module.named_children()
    }

    owners = {module: path for path, module in model.named_modules() if any(isinstance(c, nn.Linear) for c in module.children())}

    def reader_hook(child, args):
        if args and torch.is_tensor(args[0]):
            read.setdefault(readers[child], args[0])

    def output_hook(module, args, output):
        if torch.is_tensor(output):
            read.setdefault((owners[module], OUTPUT), output)

    def hook(child, args, output):
        if args and torch.is_tensor(args[0]) and torch.is_tensor(output):
            path, _, name = parent_of[child]
            inputs.append(args[0])
            calls[(path, id(args[0]))].add(name)
            seen.setdefault((path, name), (args[0], output))

    handles = [child.register_forward_hook(hook) for child in parent_of]
    handles += [m.register_forward_pre_hook(lambda m, args: called.add(m)) for m in mixtures.values()]
    handles += [child.register_forward_pre_hook(reader_hook) for child in readers]
    handles += [module.register_forward_hook(output_hook) for module in owners]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    where["moe"] = [p for p, m in mixtures.items() if m in called]
    groups: dict[str, set[frozenset]] = defaultdict(set)
    for (path, _), names in calls.items():
        if len(names) >= 2:
            groups[path].add(frozenset(names))
    for path, sets in groups.items():
        for names in sets:
            kind = "gate_up" if len(names) == 2 and _feeds_a_glu(path, sorted(names), seen, read) else "qkv"
            where[kind].append(f"{path}:{'+'.join(sorted(names))}")
    return {kind: len(where[kind]) for kind in KINDS}, dict(where)


def _failed(row: dict, status: str, exc: BaseException) -> dict:
    row.update(status=status, error=f"{type(exc).__name__}: {str(exc)[:300]}", trace=traceback.format_exc()[-2000:])
    return row


def run_type(model_type: str, progress=None) -> dict:
    """One row of the table (never raises: failures are the row's ``status``)."""
    from transfuse.tiny import tiny_model

    row: dict = {"model_type": model_type}
    started = time.perf_counter()
    try:
        stock = tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001 - a type that does not build is a row, not a failure
        return _failed(row, "does not build", exc)
    return run_model(stock, row, started, progress)


def run_model(stock, row: dict, started: float, progress=None) -> dict:
    """The rest of ``row`` for a built stock model: opportunities, the rewrite, its comparison."""
    import torch

    import transfuse
    from transfuse import census

    def failed(status, exc):
        return _failed(row, status, exc)

    row["parameters"] = sum(p.numel() for p in stock.parameters())
    if progress is not None:
        progress(dict(row))  # what a worker that dies later (out of memory) still reports
    # The copy to rewrite is taken as the model was built: a model that keeps state between calls
    # (recurrent_gemma's recurrent state, sized by the last batch) is rewritten as a user who loads
    # and rewrites it would have it, not as the stock runs below leave it.
    fused = copy.deepcopy(stock)
    try:
        vocab = stock.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
        # The structure as the rewrite is given it: a forward that replaces a module of its own
        # (big_bird's block-sparse attention, swapped for full attention on short inputs) leaves a
        # module of another class at that path, which the rewrite never saw.
        built = {path: type(module).__name__ for path, module in stock.named_modules()}
        found = census.count(stock)
        opportunities, where = count_opportunities(stock, ids)
        with torch.no_grad():
            want = stock(input_ids=ids, use_cache=False).logits
    except Exception as exc:  # noqa: BLE001 - the stock model itself does not run on token ids alone
        return failed("stock fails", exc)
    opportunities["rotary"] = sum(o.kind == "rotary" for o in found)
    where["rotary"] = [o.describe().partition(":")[2] for o in found if o.kind == "rotary"]
    row.update(opportunities=opportunities, where=where)
    replaced = sorted(p for p, m in stock.named_modules() if p in built and type(m).__name__ != built[p])
    if replaced:
        row["replaced_in_forward"] = [f"{p} ({built[p]} -> {type(stock.get_submodule(p)).__name__})" for p in replaced]
    try:
        transfuse.rewrite(fused)
    except Exception as exc:  # noqa: BLE001 - recorded: a crash inside transfuse
        return failed("crash", exc)
    report = transfuse.report(fused)
    row["fused"] = {kind: report.counts().get(kind, 0) for kind in KINDS}
    row["fused"]["rotary"] = sum(census.fused(o, report) for o in found if o.kind == "rotary")
    # An expert's GLU inside a fused mixture of experts is computed by the fused op (its gate/up projection).
    row["fused"]["gate_up"] += sum(
        census.absorbed(census.Opportunity("gate_up", e.split(":")[0], ""), report) for e in where.get("gate_up", [])
    )
    row["silent"] = silent_opportunities(stock, where, report, found, built)
    row["unrecognised"] = sorted(f"{s.kind}:{s.path}" for s in report.skipped if s.tag.endswith(".unrecognised-form"))
    row["refusals"] = sorted({s.tag for s in report.skipped})
    row["not_rewritten"] = report.not_rewritten
    try:
        with torch.no_grad():
            got = fused(input_ids=ids, use_cache=False).logits
    except Exception as exc:  # noqa: BLE001 - the rewritten model failed where the stock one ran
        return failed("crash", exc)
    row["max_logit_diff"] = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    prompt = ids[:1, :6]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    try:
        with torch.no_grad():
            expected = stock.generate(prompt, **kwargs)
    except Exception:  # noqa: BLE001 - some stock models generate only without a cache here
        kwargs["use_cache"] = False
        try:
            with torch.no_grad():
                expected = stock.generate(prompt, **kwargs)
        except Exception:  # noqa: BLE001 - nor without: logits alone are compared
            expected = None
    if expected is not None:
        try:
            with torch.no_grad():
                row["generation_equal"] = bool(torch.equal(expected, fused.generate(prompt, **kwargs)))
        except Exception as exc:  # noqa: BLE001
            return failed("crash", exc)
    else:
        row["generation_equal"] = None  # the stock model does not generate
    wrong = row["max_logit_diff"] > TOLERANCE or row["generation_equal"] is False
    row["status"] = "wrong" if wrong else "ok"
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


_PROJECTIONS = ("qkv", "gate_up")
_COUNTED = ("rms_norm", "qkv", "gate_up", "moe")  # by the hooks above; rotary by transfuse.census


def silent_opportunities(stock, where: dict[str, list[str]], report, found=(), built=None) -> list[str]:
    """The counted opportunities (``kind:module``) that the report neither fused nor refused: those
    of the counts above, and those of transfuse's own structural count (``transfuse.census``, which
    reads any module's code, not only transformers'). A refusal of a class is looked up under the
    class each module had when the model was built (``built``: path -> class name), the one the
    rewrite saw."""
    from transfuse import census

    fused = {(f.kind, f.path) for f in report.fusions}
    refused = {(s.kind, s.path) for s in report.skipped if s.path is not None}
    refused_classes = {(s.kind, s.cls) for s in report.skipped if s.path is None}
    silent = [o.describe() for o in census.unaccounted(list(found), report)]
    for kind, entries in where.items():
        if kind not in _COUNTED:
            continue
        kinds = _PROJECTIONS if kind in _PROJECTIONS else (kind,)
        for entry in entries:
            path = entry.split(":")[0]
            if census.absorbed(census.Opportunity(kind, path, ""), report):
                continue  # an expert's projections, computed by a fused mixture of experts
            # A mixture is counted at the module holding ``experts``; a fuser may take that child for the block.
            paths = [path, f"{path}.experts"] if kind == "moe" and _has(stock, f"{path}.experts") else [path]
            seen = [(p, (built or {}).get(p) or type(stock.get_submodule(p)).__name__) for p in paths]
            if not any(
                (k, p) in fused or (k, p) in refused or (k, cls) in refused_classes for k in kinds for p, cls in seen
            ):
                silent.append(f"{kind}:{entry}")
    return sorted(set(silent))


def _has(model, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _run_in_subprocess(model_type: str, timeout: float) -> dict:
    command = [sys.executable, __file__, "--one", model_type]
    env = {**os.environ, "TRANSFUSE_PROGRESS": "0"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "status": "timeout", "error": f"over {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"model_type": model_type}
    if "status" not in row:  # the worker died after its first line, or printed none
        killed = done.returncode == -9  # the kernel's out-of-memory killer
        row["status"] = "killed (memory)" if killed else "crash"
        row["error"] = f"worker exited with {done.returncode}: {(done.stderr or done.stdout)[-300:]}"
    return row


def _silent(row: dict) -> list[str]:
    """A row's silent opportunities; none where the model was not rewritten at all (the report says
    why, in place of every fusion)."""
    return [] if row.get("not_rewritten") else row.get("silent", [])


def summarise(rows: list[dict]) -> dict:
    built = [r for r in rows if r["status"] not in ("does not build", "not run")]
    compared = [r for r in rows if "fused" in r]
    totals = {kind: [0, 0] for kind in KINDS}
    for r in compared:
        for kind in KINDS:
            totals[kind][0] += min(r["fused"].get(kind, 0), r["opportunities"].get(kind, 0))
            totals[kind][1] += r["opportunities"].get(kind, 0)
    complete = [r for r in compared if all(r["fused"].get(k, 0) >= r["opportunities"].get(k, 0) for k in KINDS)]
    silent = sorted(r["model_type"] for r in compared if _silent(r))
    tags = Counter(tag for r in compared for tag in r["refusals"])
    return {
        "types": len(rows),
        "not_run": sorted(r["model_type"] for r in rows if r["status"] == "not run"),
        "built": len(built),
        "compared": len(compared),
        "wrong": sorted(r["model_type"] for r in rows if r["status"] == "wrong"),
        "crashes": sorted(r["model_type"] for r in rows if r["status"] in ("crash", "timeout")),
        "killed": sorted(r["model_type"] for r in rows if r["status"] == "killed (memory)"),
        "complete": len(complete),
        "silent": silent,
        "unrecognised": sum(len(r.get("unrecognised", [])) for r in compared),
        "totals": totals,
        "refusal_tags": dict(tags.most_common()),
    }


def _markdown(rows: list[dict], summary: dict, command: str, versions: str) -> str:
    totals = summary["totals"]

    def share(kind):
        fused, total = totals[kind]
        return f"{kind} {fused}/{total} ({100 * fused / total:.1f}%)" if total else f"{kind} 0/0"

    lines = [
        f"`{command}`",
        "",
        versions,
        "",
        f"**{summary['types']} types, "
        + (f"{len(summary['not_run'])} not run (the run's time was spent), " if summary.get("not_run") else "")
        + f"{summary['built']} build, {summary['compared']} run and were rewritten and "
        "compared; "
        f"wrong answers: {len(summary['wrong'])}; crashes: {len(summary['crashes'])}; killed for memory: "
        f"{len(summary['killed'])}; every opportunity fused in "
        f"{summary['complete']} types; {', '.join(share(k) for k in KINDS)}; opportunities neither fused nor "
        f"refused: {sum(len(_silent(r)) for r in rows)} (in {len(summary.get('silent', []))} types); "
        f"refused only as forms no fuser recognised (`*.unrecognised-form`): {summary.get('unrecognised', 0)}.**",
        "",
        "Opportunities are counted by structure (see the heuristics in `benchmarks/coverage.py`); a row's "
        "cell is fused / opportunities. Max logit difference is relative to the logits' largest magnitude.",
        "",
        "Refusal tags over all types: " + ", ".join(f"`{t}` {n}" for t, n in summary["refusal_tags"].items()),
        "",
        "| type | status | " + " | ".join(KINDS) + " | max logit diff | greedy equal | refusal tags |",
        "| --- | --- | " + " | ".join("---:" for _ in KINDS) + " | ---: | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: r["model_type"]):
        if "fused" not in r:
            size = f" ({r['parameters'] / 1e6:.0f}M parameters)" if "parameters" in r else ""
            error = r.get("error", "").replace("|", "/").replace("\n", " ")[:120]
            lines.append(f"| {r['model_type']} | {r['status']}{size}: {error} |" + " |" * (len(KINDS) + 3))
            continue
        cells = " | ".join(f"{r['fused'].get(k, 0)}/{r['opportunities'].get(k, 0)}" for k in KINDS)
        silent = "".join(f", silent: `{s}`" for s in _silent(r))
        if r.get("not_rewritten"):
            silent += f", not rewritten: {r['not_rewritten'][:160].replace('|', '/')}"
        silent += "".join(f", unrecognised: `{s}`" for s in r.get("unrecognised", []))
        silent += "".join(f", replaced by its forward: `{s}`" for s in r.get("replaced_in_forward", []))
        lines.append(
            f"| {r['model_type']} | {r['status']} | {cells} | {r['max_logit_diff']:.1e} | {r['generation_equal']} | "
            f"{', '.join(r['refusals'])}{silent} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--ci", action="store_true", help="the fixed subset CI runs")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--update",
        metavar="DIR",
        help="re-run only --types and put their rows into DIR's committed table (the others are kept)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_type(args.one, progress=lambda row: print(json.dumps(row), flush=True))))
        return 0
    import torch
    import transformers

    from transfuse.tiny import causal_lm_types

    types = CI_TYPES if args.ci else (args.types or causal_lm_types())
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(_run_in_subprocess, t, args.timeout): t for t in types}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            row = future.result()
            rows.append(row)
            print(f"[{done}/{len(types)}] {row['model_type']}: {row['status']}", file=sys.stderr, flush=True)
    command = "python benchmarks/coverage.py " + " ".join(sys.argv[1:])
    if args.update:
        old = json.loads((Path(args.update) / "coverage.json").read_text())
        first = (Path(args.update) / "COVERAGE.md").read_text().splitlines()[0].strip("`")
        fresh = {row["model_type"] for row in rows}
        rows = [row for row in old["rows"] if row["model_type"] not in fresh] + rows
        rows.sort(key=lambda row: row["model_type"])
        command = f"{first}`, then `{command}"
        args.out = args.out or args.update
    summary = summarise(rows)
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32"
    text = _markdown(rows, summary, command, versions)
    print(text.splitlines()[4])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "COVERAGE.md").write_text(text)
        (out / "coverage.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 1 if summary["wrong"] or summary["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
