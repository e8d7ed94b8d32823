"""The ``transfuse`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from . import __version__

__all__ = ["main"]


def _explain(args: argparse.Namespace) -> int:
    from .api import report, rewrite
    from .models import load_model

    logging.getLogger("transfuse").info("transfuse: loading %s", args.model)
    model = load_model(args.model)
    rewrite(model, fusions=args.fusions)
    print(report(model))
    return 0


_COLOURS = {"+": "\033[32m", "-": "\033[31m", "@": "\033[36m"}
_RESET = "\033[0m"


def _colour_diff(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith(("+++", "---")):
            lines.append(f"\033[1m{line}{_RESET}")
        elif line[:1] in _COLOURS:
            lines.append(f"{_COLOURS[line[0]]}{line}{_RESET}")
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _diff(args: argparse.Namespace) -> int:
    from .api import diff, rewrite
    from .models import load_model

    logging.getLogger("transfuse").info("transfuse: loading %s", args.model)
    model = load_model(args.model)
    rewrite(model, fusions=args.fusions)
    text = diff(model, context=args.context)
    if not text:
        print("transfuse: no source was rewritten (only modules were replaced, or nothing fused).", file=sys.stderr)
        return 0
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    sys.stdout.write(_colour_diff(text) if colour else text)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transfuse",
        description="Rewrite Hugging Face transformers models into fused kernels, with no per-model code.",
    )
    parser.add_argument("--version", action="version", version=f"transfuse {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print results only, no progress")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    model_help = "a checkpoint directory, a hub id in the local cache, or a model_type (tiny random model)"
    explain = commands.add_parser(
        "explain", parents=[common], help="rewrite MODEL and show what was fused and what was refused, and why"
    )
    explain.add_argument("model", metavar="MODEL", help=model_help)
    explain.add_argument("--fusions", nargs="+", metavar="KIND", help="only these fusion kinds")
    explain.set_defaults(run=_explain)
    diff = commands.add_parser("diff", parents=[common], help="rewrite MODEL and print what changed in its source")
    diff.add_argument("model", metavar="MODEL", help=model_help)
    diff.add_argument("--fusions", nargs="+", metavar="KIND", help="only these fusion kinds")
    diff.add_argument("--context", type=int, default=3, metavar="N", help="lines of context (default 3)")
    diff.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="colour the diff (default: on a terminal)"
    )
    diff.set_defaults(run=_diff)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if not args.quiet:
        logging.basicConfig(format="%(message)s", level=logging.WARNING)
        logging.getLogger("transfuse").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from .models import ModelError

    try:
        return args.run(args)
    except (ModelError, ValueError) as exc:
        print(f"transfuse: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
