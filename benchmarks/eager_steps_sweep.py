"""Every causal-LM type through the eager decode path's steps on the CPU: what a GPU would capture.

    python benchmarks/eager_steps_sweep.py [--out FILE] [model_type ...]

For each model type (``transfuse.tiny``; default: all of ``causal_lm_types()``), rewritten, a
padded batch of three decodes 10 tokens greedily through ``generate`` with the path turned off
and on (``transfuse/compile/eager_steps.py``, its steps through the store without graphs, as
``tests/test_eager_steps.py`` runs it on the CPU). Each model gets one line: OK (tokens equal to
the path off, and from the second step on every step issued the same ops, launches aside, with
no host reads: ``tests/test_eager_steps.py``'s trace), abandoned (the path gave the step back to
the model's own forward: a layer's attention of its own, or an error; tokens equal), refused
(with the reason), no store steps (a sliding window or no cache: the model's own forward), or a
failure, saying whether the model fails with the path off too. With ``--compiled``: each model
through ``transfuse.compile`` (no Inductor) instead, every step's logits compared with the
uncompiled model's. Takes a few minutes either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import transfuse  # noqa: E402
from transfuse.compile import eager_steps  # noqa: E402
from transfuse.tiny import causal_lm_types, tiny_model  # noqa: E402
from tests.test_compile import _padded_batch  # noqa: E402
from tests.test_eager_steps import _READ_ON_THE_HOST, admitted_on_cpu, tracing_steps  # noqa: E402


def _on_cpu() -> None:
    """The path's steps through the store on the CPU, as the tests' ``store_on_cpu`` fixture does."""
    eager_steps.STORE = True
    eager_steps._admission = admitted_on_cpu(eager_steps._admission)


def _generate(model, ids, mask, on: bool):
    os.environ[eager_steps.ENV] = "1" if on else "0"
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)


def _rewritten(model_type: str):
    """The tiny model of this type, rewritten, or why not (a string)."""
    try:
        torch.manual_seed(0)
        return transfuse.decode_steps(transfuse.rewrite(tiny_model(model_type).eval()))
    except Exception as exc:  # noqa: BLE001 - reported
        return f"not built or rewritten here ({type(exc).__name__})"


def one(model_type: str) -> str:
    model = _rewritten(model_type)
    if isinstance(model, str):
        return model
    ids, mask = _padded_batch()
    try:
        off = _generate(model, ids, mask, on=False)
    except Exception as exc:  # noqa: BLE001 - reported
        off = f"{type(exc).__name__}"
    traces = []
    made = eager_steps.EagerSteps.__init__
    eager_steps.EagerSteps.__init__ = tracing_steps(traces)
    try:
        on = _generate(model, ids, mask, on=True)
    except Exception as exc:  # noqa: BLE001 - reported
        first = str(exc).splitlines()[0][:90] if str(exc) else ""
        return f"FAILS with the path on ({type(exc).__name__}: {first}); " + (
            f"fails with it off too ({off})" if isinstance(off, str) else "WORKS WITH IT OFF"
        )
    finally:
        eager_steps.EagerSteps.__init__ = made
    stats = eager_steps.stats(model)
    if isinstance(off, str):
        return f"works with the path on, fails with it off ({off})"
    if not torch.equal(on, off):
        return "TOKENS DIFFER from the path turned off"
    if stats["failed"]:
        return f"abandoned, tokens equal ({stats['failed'][:90]})"
    if stats["refused"]:
        return f"refused ({stats['refused'][:90]})"
    if len(traces) < 3:
        return "no store steps (the model's own forward)"
    reads = set().union(*({op for op, _ in trace} & _READ_ON_THE_HOST for trace in traces))
    if reads:
        return f"HOST READS in a step: {sorted(reads)}"
    if any(trace != traces[1] for trace in traces[2:]):
        return "STEPS DIFFER from the second"
    return "OK"


def one_compiled(model_type: str) -> str:
    """The same model through ``transfuse.compile`` (no Inductor): each step's logits against the
    uncompiled model's, within 1e-4."""
    from transfuse.compile import CompileError

    model = _rewritten(model_type)
    if isinstance(model, str):
        return model
    ids, mask = _padded_batch()
    os.environ[eager_steps.ENV] = "0"

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)

    try:
        want = generate()
    except Exception as exc:  # noqa: BLE001 - reported
        return f"fails uncompiled ({type(exc).__name__})"
    try:
        transfuse.compile(model, inductor=False)
    except CompileError as exc:
        return f"refused ({str(exc)[:90]})"
    try:
        got = generate()
    except Exception as exc:  # noqa: BLE001 - reported
        first = str(exc).splitlines()[0][:90] if str(exc) else ""
        return f"FAILS compiled, not uncompiled ({type(exc).__name__}: {first})"
    finally:
        torch._dynamo.reset()
    difference = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))
    if not torch.equal(got.sequences, want.sequences) or difference > 1e-4:
        return f"LOGITS DIFFER by {difference:.2e}"
    abandoned = model._transfuse_compiled.abandoned
    return f"given up, logits equal ({abandoned[:90]})" if abandoned else "OK"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--out", default=None)
    parser.add_argument("--compiled", action="store_true", help="transfuse.compile's calls instead, logits compared")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    _on_cpu()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    lines = []
    for model_type in args.model_types or causal_lm_types():
        line = f"{model_type:28s} {(one_compiled if args.compiled else one)(model_type)}"
        print(line, flush=True)
        lines.append(line)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
