"""The ``transfuse`` command line: demo, explain, diff, emit, compile.

Parsing the arguments imports neither torch nor transformers (``--help`` and ``--version`` answer
at once); a command says what it loads before it imports them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import warnings

from .version import __version__

__all__ = ["main"]

log = logging.getLogger("transfuse")

MODEL_HELP = "a checkpoint directory, a .gguf file, a hub id in the local cache, or a model_type (tiny random model)"


def _load_options(args: argparse.Namespace) -> dict:
    return {"trust_remote_code": args.trust_remote_code, "allow_missing_weights": args.allow_missing_weights}


def _load_and_rewrite(args: argparse.Namespace):
    from .api import rewrite
    from .models import load_model

    model = load_model(args.model, **_load_options(args))
    return rewrite(model, fusions=args.fusions)


def _explain(args: argparse.Namespace) -> int:
    from .api import report

    model = _load_and_rewrite(args)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__} from {args.model}: {parameters / 1e6:.2f} M parameters")
    print(report(model))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from .api import diff
    from .presentation.diffview import colour, review_page

    model = _load_and_rewrite(args)
    text = diff(model, context=args.context)
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(review_page(model, args.model))
        log.info("transfuse: wrote the review page %s", args.html)
    if not text:
        print("transfuse: no source was rewritten (only modules were replaced, or nothing fused).", file=sys.stderr)
        return 0
    use_colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    sys.stdout.write(colour(text) if use_colour else text)
    return 0


def _emit(args: argparse.Namespace) -> int:
    from .models import gguf_parsed_once, is_gguf, load_gguf_tokenizer, resolve_checkpoint
    from .rewriter.emit import emit
    from .rewriter.emit_dir import check_destination

    gguf = is_gguf(args.model)
    checkpoint = resolve_checkpoint(args.model)
    # Before the load and the rewrite, not after them.
    for note in check_destination(args.out, force=args.force, source=args.model if gguf else checkpoint, force_is="--force"):
        print(f"note: {note}")
    # A GGUF file's tokenizer comes from the file too: read with the weights, from one parse of it.
    with gguf_parsed_once() if gguf else contextlib.nullcontext():
        model = _load_and_rewrite(args)
        gguf_tokenizer = load_gguf_tokenizer(args.model) if gguf else None

    def tokenizer(directory: str) -> list[str]:
        gguf_tokenizer.save_pretrained(directory)
        return ["tokenizer"]

    result = emit(model, args.out, checkpoint_dir=checkpoint, force=args.force, link=args.link, also=tokenizer if gguf else None)
    for note in result.notes:
        print(f"note: {note}")
    print(f"dtype: {str(model.dtype).removeprefix('torch.')}, {_dtype_origin(args.model, checkpoint)}")
    print(f"wrote {result.out_dir}: {', '.join(result.files)}")
    print(f"load it with: AutoModelForCausalLM.from_pretrained({result.out_dir!r}, trust_remote_code=True)")
    return 0


def _compile(args: argparse.Namespace) -> int:
    import torch

    import transfuse

    model = _load_and_rewrite(args)
    if torch.cuda.is_available():
        model = model.to("cuda")
    cache_dir = False if args.no_cache else args.cache_dir
    transfuse.compile(model, cache_dir=cache_dir)
    seconds = transfuse.compile.warm_up(
        model, batch_sizes=tuple(args.batch_sizes), prompt_length=args.prompt_length, new_tokens=args.new_tokens
    )
    entry = model._transfuse_compiled.cache_entry
    for batch, took in seconds.items():
        print(f"batch size {batch}: compiled and captured in {took:.1f} s")
    if entry is None:
        print("compile cache: off")
    else:
        state = "loaded, then written" if entry.loaded else "written"
        print(f"compile cache: {entry.path} ({state}); a process that compiles this model the same way reuses it")
    return 0


def _dtype_origin(spec: str, checkpoint: str | None) -> str:
    from .models import is_gguf

    if is_gguf(spec):
        return "dequantised from the GGUF file"
    if checkpoint is not None:
        return "the checkpoint's (as from_pretrained loads it)"
    return "a tiny random model's"


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(
        args.model, tokens=args.tokens, new_tokens=args.new_tokens, checkpoint=args.checkpoint, **_load_options(args)
    )


# The fusion kinds, in the fusers' order, and the opt-in ones among them: named here so that parsing
# the command line imports no fuser (and so no torch); ``tests/test_cli.py`` checks them against
# ``transfuse.fusers``.
FUSION_KINDS = ("rms_norm", "add_rms_norm", "qkv", "rotary", "gate_up", "moe", "linear_cross_entropy")
OPT_IN_KINDS = ("linear_cross_entropy",)


def kinds() -> list[str]:
    return list(FUSION_KINDS)


def _kind_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in kinds()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown fusion kind {', '.join(map(repr, unknown)) or repr(text)}; the kinds are: {', '.join(kinds())}"
        )
    return names


def _fusions_help() -> str:
    opt_in = OPT_IN_KINDS
    return (
        f"only these fusion kinds, in any order, comma- or space-separated: {', '.join(kinds())} "
        f"(default: all but the opt-in {', '.join(opt_in)})"
    )


def _gather_fusions(argv: list[str]) -> list[str]:
    """``--fusions a b MODEL`` as ``--fusions=a,b MODEL``: the kinds after the flag are taken while they
    are kinds, so the option may come before or after MODEL."""
    known = set(kinds())
    out, i = [], 0
    while i < len(argv):
        if argv[i] != "--fusions":
            out.append(argv[i])
            i += 1
            continue
        taken, i = [], i + 1
        while i < len(argv) and not argv[i].startswith("-") and set(argv[i].split(",")) <= known | {""}:
            taken.append(argv[i])
            i += 1
        if taken:
            out.append("--fusions=" + ",".join(taken))
        else:
            out.append("--fusions")
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transfuse",
        description="Rewrite Hugging Face transformers models into fused kernels, with no per-model code.",
    )
    parser.add_argument("--version", action="version", version=f"transfuse {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print results only, no progress")
    common.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the code a checkpoint brings (its auto_map classes); without it such a checkpoint is refused",
    )
    common.add_argument(
        "--allow-missing-weights",
        action="store_true",
        help="load a checkpoint that lacks some of the model's weights (they start random); without it that is an error",
    )
    with_model = argparse.ArgumentParser(add_help=False, parents=[common])
    with_model.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    with_model.add_argument("--fusions", type=_kind_list, metavar="KIND[,KIND...]", help=_fusions_help())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo", parents=[common], help="rewrite a built-in small model; check and time it against the original"
    )
    demo.add_argument("model", metavar="MODEL", nargs="?", default=None, help="a model_type (default: a small llama)")
    demo.add_argument("--checkpoint", metavar="PATH", help="a real checkpoint instead: a directory or a .gguf file")
    demo.add_argument("--tokens", type=int, default=128, help="prompt length for the timing (default 128)")
    demo.add_argument("--new-tokens", type=int, default=20, help="tokens to generate greedily (default 20)")
    demo.set_defaults(run=_demo)

    explain = commands.add_parser(
        "explain", parents=[with_model], help="rewrite MODEL and show what was fused and what was refused, and why"
    )
    explain.set_defaults(run=_explain)

    diff = commands.add_parser("diff", parents=[with_model], help="rewrite MODEL and print what changed in its source")
    diff.add_argument("--context", type=int, default=3, metavar="N", help="lines of context (default 3)")
    diff.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="default: on a terminal")
    diff.add_argument(
        "--html", metavar="FILE", help="also write a review page to FILE: report, contents, unified and side-by-side views"
    )
    diff.set_defaults(run=_diff)

    emit = commands.add_parser(
        "emit", parents=[with_model], help="write the rewritten modeling file(s), config and weights to a directory"
    )
    emit.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist, unless --force)")
    emit.add_argument("--force", action="store_true", help="replace DIR if it exists")
    emit.add_argument("--link", action="store_true", help="link the checkpoint's weight files instead of copying them")
    emit.set_defaults(run=_emit)

    compile_ = commands.add_parser(
        "compile",
        parents=[with_model],
        help="rewrite and compile MODEL now (transfuse.compile and its warm-up), filling the compile cache ahead of time",
    )
    compile_.add_argument("--batch-sizes", type=int, nargs="+", default=[1], metavar="N", help="batch sizes to compile and capture (default 1)")
    compile_.add_argument("--prompt-length", type=int, default=16, metavar="N", help="prompt length of the warm-up (default 16)")
    compile_.add_argument("--new-tokens", type=int, default=4, metavar="N", help="decode steps of the warm-up (default 4)")
    compile_.add_argument("--cache-dir", metavar="DIR", default=None, help="the compile cache's directory (default: TRANSFUSE_CACHE_DIR or ~/.cache/transfuse/compile)")
    compile_.add_argument("--no-cache", action="store_true", help="compile without the cache (to time it)")
    compile_.set_defaults(run=_compile)
    return parser


# Loggers of libraries transformers imports while it loads a model, which log as they are imported:
# torchao (its quantizer's backend) that its CUDA libraries do not load on a CPU build of torch, and
# torch's pytree a deprecation in how torchao registers its types.
_IMPORT_CHATTER = ("torchao", "torch.utils._pytree")


def _what_loads(args: argparse.Namespace) -> str:
    if args.command == "demo":
        return args.checkpoint or f"a small random {args.model or 'llama'}"
    return args.model


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(_gather_fusions(list(sys.argv[1:] if argv is None else argv)))
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    if args.command == "emit":  # an output it may not write is refused before any work
        from .rewriter.emit_dir import EmitError, check_destination

        try:
            for line in check_destination(args.out, force=args.force, force_is="--force"):
                print(f"note: {line}")
        except EmitError as exc:
            print(f"transfuse: error: {exc}", file=sys.stderr)
            return 1
    # The first line, before torch and transformers are imported (seconds on a busy machine).
    log.info("transfuse: loading %s", _what_loads(args))
    warnings.filterwarnings("ignore", module="transformers")
    for name in _IMPORT_CHATTER:
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.quiet or not _is_terminal(sys.stderr):
        hf_logging.disable_progress_bar()  # bars only on a terminal (on standard error), as transformers'
    import transfuse

    transfuse.load()  # the package's names and the integrations' hooks, as ``import transfuse`` gives them
    from . import settings
    from .models import ModelError
    from .rewriter.emit import EmitError

    start = time.perf_counter()
    try:
        settings.validate()
        status = args.run(args)
    except (ModelError, EmitError, ValueError, OSError) as exc:
        print(f"transfuse: error: {exc}", file=sys.stderr)
        return 1
    log.info("transfuse: done in %.1f s", time.perf_counter() - start)
    return status


if __name__ == "__main__":
    sys.exit(main())
