"""Peak memory of loading a checkpoint: transformers' from_pretrained against transfuse's.

Each load runs in a fresh process, then one forward pass of 8 tokens (so both loaders end
having touched every weight); the peak is the process's maximum resident set size
(ru_maxrss), which includes the interpreter, torch and transformers alike. The difference
is what the rewrite adds: merging a group of projections allocates the merged tensor
before the originals are freed, plus the probe's activations.

Load in a dtype other than the checkpoint's (the default, bfloat16, for a float32
checkpoint) so that both loaders materialise the weights: with a zero-copy (memory-mapped)
load, transformers' weights are file pages that RSS counts only once touched, while
merged tensors can only live in anonymous memory, and the comparison would measure the
page cache rather than the loaders.

    python benchmarks/load_memory.py CHECKPOINT_DIR [--dtype bfloat16]
"""

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
loader, path, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
if loader == "transformers":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
else:
    import transfuse
    model = transfuse.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
with torch.no_grad():
    model(input_ids=torch.arange(8)[None])
weights = sum(p.numel() * p.element_size() for p in model.parameters())
layers = getattr(model.config, "num_hidden_layers", 1)
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "weights_mib": weights / 2**20, "layers": layers}))
"""


def measure(loader: str, path: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, loader, path, dtype], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    for loader in ("transformers", "transfuse"):
        runs = [measure(loader, args.checkpoint, args.dtype) for _ in range(args.repeats)]
        rows[loader] = min(r["peak_mib"] for r in runs), runs[0]
    base, info = rows["transformers"]
    fused, _ = rows["transfuse"]
    per_layer = info["weights_mib"] / info["layers"]
    print(f"checkpoint: {args.checkpoint} ({info['weights_mib']:.0f} MiB of weights, {info['layers']} layers, "
          f"about {per_layer:.1f} MiB per layer)")
    print(f"peak RSS, best of {args.repeats}: transformers {base:.0f} MiB, transfuse {fused:.0f} MiB, "
          f"difference {fused - base:+.0f} MiB ({(fused - base) / per_layer:+.2f} layers)")


if __name__ == "__main__":
    main()
