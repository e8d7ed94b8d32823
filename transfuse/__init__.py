"""transfuse: rewrite Hugging Face transformers models into fused, platform-dispatched kernels.

    import transfuse
    model = transfuse.rewrite(model)      # in place; returns the same object
    print(transfuse.report(model))        # what was fused, what was refused and why

    model = transfuse.AutoModelForCausalLM.from_pretrained(path_or_id, dtype=torch.bfloat16)
    model = transfuse.compile(model)      # inference: attention outside the graph, CUDA graphs

    transfuse.decode_steps(model)         # a rewritten model's generate: decode steps as CUDA graphs
"""

from . import integrations  # registers the integrations' hooks; imports none of their libraries
from .api import ExampleInputsError, RewriteError, diff, is_rewritten, report, rewrite
from .auto import AutoModelForCausalLM, from_pretrained
from . import compile  # noqa: A004 - a callable module: transfuse.compile(model)
from .compile.eager_steps import decode_steps
from .rewriter.report import FusionRecord, RewriteReport, SkipRecord
from .version import __version__

__all__ = [
    "AutoModelForCausalLM",
    "ExampleInputsError",
    "FusionRecord",
    "RewriteError",
    "RewriteReport",
    "SkipRecord",
    "__version__",
    "compile",
    "decode_steps",
    "diff",
    "from_pretrained",
    "is_rewritten",
    "report",
    "rewrite",
]
