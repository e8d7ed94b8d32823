"""Loads emitted directories with torch and transformers alone and saves their logits.

    python standalone_loader.py JOBS.json [--block-transfuse]

Run in a process of its own: in an environment without transfuse, or in this one with
``--block-transfuse``, which makes ``import transfuse`` fail as it does where transfuse is not
installed. JOBS.json lists ``{"dir": ..., "ids": ..., "out": ...}``: each directory is loaded with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``, and its logits on the ids
(a tensor saved with ``torch.save``) are saved to ``out`` with what the load showed: the model's
module, how many merged projections it holds, and the emitted runtime's log lines. This script
imports neither transfuse nor anything of this repository.
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import sys


class BlockTransfuse(importlib.abc.MetaPathFinder):
    """``import transfuse`` (and its submodules) fails as for a package that is not installed."""

    def __init__(self):
        self.attempts: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name == "transfuse" or name.startswith("transfuse."):
            self.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


class Lines(logging.Handler):
    """The records of the emitted runtimes' loggers (``transformers_modules.<...>.transfuse_runtime``)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        if record.name.endswith("transfuse_runtime"):
            self.lines.append(f"{record.levelname}: {record.getMessage()}")


def run(job: dict, lines: Lines) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    lines.lines.clear()
    model = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=True).eval()
    # Fresh copies of the loaded tensors: CPU kernels may sum in another order for tensors that the
    # checkpoint's memory map left unaligned (tests/test_emit_and_load.py says more).
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    ids = torch.load(job["ids"])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    merged = sum(type(m).__name__ == "MergedProjection" for m in model.modules())
    classes = sorted({type(m).__module__ for m in model.modules()})
    torch.save({"logits": logits, "merged": merged, "modules": classes, "log": list(lines.lines)}, job["out"])


def main(argv: list[str]) -> int:
    jobs, flags = argv[0], argv[1:]
    blocker = BlockTransfuse()
    if "--block-transfuse" in flags:
        sys.meta_path.insert(0, blocker)
    lines = Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.INFO)
    with open(jobs, encoding="utf-8") as f:
        for job in json.load(f):
            run(job, lines)
    if "transfuse" in sys.modules:
        print("transfuse was imported", file=sys.stderr)
        return 1
    print(json.dumps({"blocked imports": blocker.attempts}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
