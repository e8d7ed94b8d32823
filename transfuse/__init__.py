"""transfuse: rewrite Hugging Face transformers models into fused, platform-dispatched kernels.

    import transfuse
    model = transfuse.rewrite(model)      # in place; returns the same object
    print(transfuse.report(model))        # what was fused, what was refused and why
"""

__version__ = "0.1.0"

from .api import diff, report, rewrite
from .rewriter.report import FusionRecord, RewriteReport, SkipRecord

__all__ = ["FusionRecord", "RewriteReport", "SkipRecord", "__version__", "diff", "report", "rewrite"]
