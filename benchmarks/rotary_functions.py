"""Which RoPE functions the rotary fusion proves, refuses or passes over.

    python benchmarks/rotary_functions.py                 # transformers' own, as installed
    python benchmarks/rotary_functions.py --source DIR    # modeling_*.py files under DIR (older releases)

Without ``--source``: imports every ``transformers.models.<name>.modeling_<name>`` that imports on
this machine and takes its ``apply_rotary_pos_emb`` where it has one. With ``--source``: reads
every PyTorch ``modeling_*.py`` under DIR (an unpacked older wheel, say) and runs only its
module-level function definitions, each on its own in a namespace holding ``torch`` (the files
themselves would not import against this transformers); definitions that need anything else are
left out. Either way, runs the fuser's proof in each call form (the layout it proves for each) and
its classification of the forms it refuses (``transfuse/fusers/rotary.py``) and prints a count per
outcome with the modules.
About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
from collections import defaultdict
from pathlib import Path


def _installed() -> dict[str, object]:
    import transformers.models as models

    found = {}
    for info in pkgutil.iter_modules(models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # noqa: BLE001 - a model whose file does not import here (optional packages)
            continue
        function = getattr(module, "apply_rotary_pos_emb", None)
        if function is not None:
            found[info.name] = function
    return found


def _from_source(directory: Path) -> dict[str, object]:
    """``apply_rotary_pos_emb`` of each file, its module-level functions defined from source alone."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    found = {}
    for path in sorted(directory.rglob("modeling_*.py")):
        if path.name.startswith(("modeling_tf_", "modeling_flax_")):
            continue
        tree = ast.parse(path.read_text())
        namespace = {"torch": torch, "nn": nn, "F": F, "Optional": object, "Tuple": object}
        namespace["__name__"] = f"{path.parent.name}.{path.stem}"
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                node.decorator_list = []
                try:
                    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)  # noqa: S102
                except Exception:  # noqa: BLE001 - a definition that needs more than torch
                    continue
        if "apply_rotary_pos_emb" in namespace:
            found[path.stem.removeprefix("modeling_")] = namespace["apply_rotary_pos_emb"]
    return found


def _layout(layout) -> str:
    """The layout's parameters that are not the default's."""
    named = layout.keywords()
    dim = named.pop("unsqueeze_dim")
    return ", ".join([f"unsqueeze_dim {dim}", *(k if v is True else f"{k}={v}" for k, v in named.items())])


def main() -> None:
    from transfuse.fusers.rotary import _near_miss, prove
    from transfuse.ops.rotary import FOUR, IGNORED_FIFTH, INDEXED, ONE, ONE_SIN_FIRST

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="read modeling_*.py files under this directory instead")
    args = parser.parse_args()
    functions = _from_source(args.source) if args.source else _installed()
    forms = {
        FOUR: "(q, k, cos, sin)",
        INDEXED: "cos and sin read at position_ids",
        IGNORED_FIFTH: "position_ids ignored",
        ONE: "(x, cos, sin)",
        ONE_SIN_FIRST: "(x, sin, cos)",
    }
    outcomes: dict[str, list[str]] = defaultdict(list)
    for name, function in functions.items():
        proved = [f"{text}: {_layout(layout)}" for form, text in forms.items() if (layout := prove(function, form))]
        near = _near_miss(function)
        if proved:
            outcome = "proved (" + "; ".join(proved) + ")"
        elif near is not None:
            outcome = f"refused as {near[0]}"
        else:
            outcome = "passed over: not a rotation by cos and sin"
        outcomes[outcome].append(name)
    total = sum(len(names) for names in outcomes.values())
    print(f"{total} modeling files define apply_rotary_pos_emb")
    for outcome, names in sorted(outcomes.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names) if len(names) <= 60 else ", ".join(names[:60]) + ", ..."
        print(f"{len(names):4d}  {outcome}: {shown}")


if __name__ == "__main__":
    main()
