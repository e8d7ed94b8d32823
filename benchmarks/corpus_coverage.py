"""Coverage on third-party code: the coverage sweep's measurement on every entry of the corpus of
older transformers releases' causal-LM modeling files (``third_party_corpus.py``).

    python benchmarks/corpus_coverage.py --cache DIR --out FILE.md             # every entry
    python benchmarks/corpus_coverage.py --cache DIR --entries llama@4.36.2    # some entries
    python benchmarks/corpus_coverage.py --cache DIR --one llama@4.36.2        # entries in this process, JSON lines

Entries run in the order of ``third_party_corpus.by_idioms`` (files with more of the idioms counted
first), so that a run cut short by ``--minutes`` has measured those; the rest are rows "not run".
Each entry is built from its tiny configuration (float32, CPU) in a worker subprocess (``--batch``
entries one after another, ``--jobs`` workers at a time), then
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


def _in_subprocess(cache: Path, names: list[str], timeout: float, stop_at: float = float("inf")) -> list[dict]:
    """The rows of ``names``, run one after another in one worker (the imports are paid once); an
    entry the worker did not finish (it died or ran out of time on it) is a row of its own kind and
    the entries after it run again, one worker each. Past ``stop_at`` (``time.time()``) nothing starts."""
    if time.time() > stop_at:
        return [{"model_type": n, "status": "not run", "error": "the run's --minutes were spent"} for n in names]
    command = [sys.executable, __file__, "--cache", str(cache), "--one", *names]
    env = {**os.environ, "TRANSFUSE_PROGRESS": "0"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout * len(names), env=env)
        output, code, error = done.stdout, done.returncode, done.stderr or done.stdout
    except subprocess.TimeoutExpired as exc:
        output, code, error = (exc.stdout or b"").decode(errors="replace"), None, ""
    rows: dict[str, dict] = {}
    for line in output.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[row["model_type"]] = row
    finished = [n for n in names if "status" in rows.get(n, {})]
    unfinished = [n for n in names if n not in finished]
    if not unfinished:
        return [rows[n] for n in names]
    stuck = next((n for n in unfinished if n in rows), unfinished[0])  # the one it was running
    row = rows.get(stuck, {"model_type": stuck})
    if code is None:
        row.update(status="timeout", error=f"the worker ran past {timeout * len(names):.0f} s")
    else:
        row["status"] = "killed (memory)" if code == -9 else "crash"
        row["error"] = f"worker exited with {code}: {error[-300:]}"
    rest = [n for n in unfinished if n != stuck]
    again = [r for n in rest for r in _in_subprocess(cache, [n], timeout, stop_at)]
    return [rows[n] for n in finished] + [row] + again


def _finished(out: Path) -> dict[str, dict]:
    """The rows of an earlier run (``--resume``) that need not run again (not timed out, not "not run")."""
    path = out.with_suffix(".rows.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return {r["model_type"]: r for r in rows if r.get("status") not in ("timeout", "not run", None)}


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
    parser.add_argument("--batch", type=int, default=6, help="entries per worker process")
    parser.add_argument("--minutes", type=float, help="start no worker after this many minutes (the rest: 'not run')")
    parser.add_argument(
        "--resume", action="store_true", help="keep the finished rows of --out's .rows.jsonl and run the others"
    )
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        for name in args.one:
            row = run_entry(args.cache, name, progress=lambda row: print(json.dumps(row), flush=True))
            print(json.dumps(row), flush=True)
        return 0
    import torch
    import transformers

    corpus.prepare(args.cache)
    found, excluded = corpus.entries(args.cache)
    names = args.entries or [e.name for e in corpus.by_idioms(args.cache, found)]
    kept = _finished(args.out) if args.resume and args.out else {}
    names = [n for n in names if n not in kept]
    stop_at = time.time() + 60 * args.minutes if args.minutes else float("inf")
    batches = [names[i : i + args.batch] for i in range(0, len(names), args.batch)]
    rows = list(kept.values())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_in_subprocess, args.cache, batch, args.timeout, stop_at) for batch in batches]
        for future in concurrent.futures.as_completed(futures):
            for row in future.result():
                rows.append(row)
                if args.out:  # kept as they come: a run cut short still has its rows
                    with args.out.with_suffix(".rows.jsonl").open("a") as jsonl:
                        jsonl.write(json.dumps(row) + "\n")
                print(f"[{len(rows)}/{len(names) + len(kept)}] {row['model_type']}: {row['status']}", file=sys.stderr, flush=True)
    summary = coverage.summarise(rows)
    command = "python benchmarks/corpus_coverage.py " + " ".join(sys.argv[1:])
    versions = f"transformers {transformers.__version__} (installed), torch {torch.__version__}, CPU, float32"
    text = coverage._markdown(rows, summary, command, versions)
    if kept:
        command += f" --resume (its {len(kept)} finished rows kept from the run before)"
        text = coverage._markdown(rows, summary, command, versions)
    head, _, rest = text.partition("\n\n")
    text = head + "\n\n" + "\n".join(_preface(excluded, [r["model_type"] for r in rows])) + "\n" + rest
    text = text.replace(" types, ", " entries, ", 1)
    print(next(line for line in text.splitlines() if line.startswith("**")))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 1 if summary["wrong"] or summary["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
