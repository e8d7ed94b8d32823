"""Which of transformers' own RoPE functions the rotary fusion proves, refuses or passes over.

    python benchmarks/rotary_functions.py

Imports every ``transformers.models.<name>.modeling_<name>`` that imports on this machine, takes
its ``apply_rotary_pos_emb`` where it has one, and runs the fuser's proof on it
(``transfuse/fusers/rotary.py``). Prints a count per outcome and the modules of the rarer ones.
About a minute on 2 CPU cores.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import defaultdict


def main() -> None:
    import transformers.models as models

    from transfuse.fusers.rotary import _graph_is_polynomial, _rotates_half, _takes_four, rotary_unsqueeze_dim

    outcomes: dict[str, list[str]] = defaultdict(list)
    for info in pkgutil.iter_modules(models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # noqa: BLE001 - a model whose file does not import here (optional packages)
            continue
        function = getattr(module, "apply_rotary_pos_emb", None)
        if function is None:
            continue
        if not _takes_four(function):
            outcome = "passed over: not (q, k, cos, sin, ...)"
        elif rotary_unsqueeze_dim(function) is not None:
            outcome = f"proved (unsqueeze_dim {rotary_unsqueeze_dim(function)})"
        elif _graph_is_polynomial(function):
            outcome = "graph passes, values differ: not fused"
        elif _rotates_half(function):
            outcome = "refused as rotary.form"
        else:
            outcome = "passed over: no half rotation"
        outcomes[outcome].append(info.name)
    total = sum(len(names) for names in outcomes.values())
    print(f"{total} modeling files define apply_rotary_pos_emb")
    for outcome, names in sorted(outcomes.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names) if len(names) <= 60 else ", ".join(names[:60]) + ", ..."
        print(f"{len(names):4d}  {outcome}: {shown}")


if __name__ == "__main__":
    main()
