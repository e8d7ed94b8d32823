"""Coverage on third-party code: the coverage sweep's measurement on every entry of the corpus of
older transformers releases' causal-LM modeling files (``third_party_corpus.py``).

    python benchmarks/corpus_coverage.py --cache DIR --out FILE.md             # every entry
    python benchmarks/corpus_coverage.py --cache DIR --entries llama@4.36.2    # some entries
    python benchmarks/corpus_coverage.py --cache DIR --one llama@4.36.2        # one entry, a JSON line

Each entry is built from its tiny configuration (float32, CPU) in a subprocess of its own, then
measured exactly as ``coverage.py`` measures a transformers type (``coverage.run_model``):
opportunities counted by structure (the forward hooks of ``coverage.py`` and ``transfuse.census``,
which reads any module's source; rotary call sites from the census), the rewrite with the default
fusions, logits and 8 greedy tokens against the stock model. An entry whose files do not import or
whose model does not build or run is a row with its reason: the corpus's exclusions.

The table's ``silent`` entries are opportunities neither fused nor refused; ``unrecognised`` ones
are those the rewrite refused only because the census found them and no fuser recognised the form
(``<kind>.unrecognised-form``): what a rewrite without that rule would have passed over silently.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import coverage  # noqa: E402 - a sibling script
import third_party_corpus as corpus  # noqa: E402


def run_entry(cache: Path, name: str, progress=None) -> dict:
    """One row (never raises: failures are the row's ``status``)."""
    row: dict = {"model_type": name}
    started = time.perf_counter()
    corpus.prepare(cache)
    try:
        stock = corpus.load(corpus.by_name(cache, name))
    except Exception as exc:  # noqa: BLE001 - an entry that does not import or build is a row
        return coverage._failed(row, "does not build", exc)
    return coverage.run_model(stock, row, started, progress)


def _in_subprocess(cache: Path, name: str, timeout: float) -> dict:
    command = [sys.executable, __file__, "--cache", str(cache), "--one", name]
    env = {**os.environ, "TRANSFUSE_PROGRESS": "0"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": name, "status": "timeout", "error": f"over {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"model_type": name}
    if "status" not in row:
        row["status"] = "killed (memory)" if done.returncode == -9 else "crash"
        row["error"] = f"worker exited with {done.returncode}: {(done.stderr or done.stdout)[-300:]}"
    return row


def _preface(excluded: dict[str, str], names: list[str]) -> list[str]:
    releases = ", ".join(f"transformers {r}" for r in corpus.RELEASES)
    lines = [
        f"Corpus: every `modeling_*.py` of the PyPI wheels of {releases} that defines a `*ForCausalLM` "
        f"class, one entry per class ({len(names)} entries; `type@release`, with `:Class` where a file "
        "has more than one), loaded as remote code through `benchmarks/third_party_shims.py`. An entry "
        "that does not build or run is listed with its error: the corpus's exclusions by rule.",
        "",
        "Excluded before loading: " + "; ".join(f"`{n}`: {r}" for n, r in excluded.items()),
        "",
        "Rotary opportunities are the census's call sites of rotary functions; a call site counts as fused "
        "when the module calling it has a rotary fusion.",
        "",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=corpus.DEFAULT_CACHE)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--entries", nargs="*", help="entry names (default: every entry)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_entry(args.cache, args.one, progress=lambda row: print(json.dumps(row), flush=True))))
        return 0
    import torch
    import transformers

    corpus.prepare(args.cache)
    found, excluded = corpus.entries(args.cache)
    names = args.entries or [e.name for e in found]
    rows = []
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".rows.jsonl").write_text("")
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_in_subprocess, args.cache, name, args.timeout) for name in names]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            row = future.result()
            rows.append(row)
            if args.out:  # kept as they come: a run cut short still has its rows
                with args.out.with_suffix(".rows.jsonl").open("a") as kept:
                    kept.write(json.dumps(row) + "\n")
            print(f"[{done}/{len(names)}] {row['model_type']}: {row['status']}", file=sys.stderr, flush=True)
    summary = coverage.summarise(rows)
    command = "python benchmarks/corpus_coverage.py " + " ".join(sys.argv[1:])
    versions = f"transformers {transformers.__version__} (installed), torch {torch.__version__}, CPU, float32"
    text = coverage._markdown(rows, summary, command, versions)
    head, _, rest = text.partition("\n\n")
    text = head + "\n\n" + "\n".join(_preface(excluded, names)) + "\n" + rest
    text = text.replace(" types, ", " entries, ", 1)
    print(next(line for line in text.splitlines() if line.startswith("**")))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 1 if summary["wrong"] or summary["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
