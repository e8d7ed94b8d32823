"""Parameters and modules held in more than one place of a model, and the fusions they refuse.

A merge concatenates its parts' weights into new tensors, and a replacement takes the module's
place at one path only: either would split what the model shares (``layers[1].q_proj.weight =
layers[0].q_proj.weight``, one module under two names), so that one copy then trains, saves and
computes apart from the other. A fusion that rebuilds a shared parameter or module is refused with
the names it is shared under (``<kind>.shared-weight``, ``<kind>.shared-module``); the model's other
fusions go on. Places are counted as slots (parent object, attribute name), so a module that is
shared as a whole together with its children (one attention block in two layers) is fused once,
for both.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from .fusion import Refusal

__all__ = ["Sharing"]


class Sharing:
    """Where each module and parameter of ``model`` is held: (parent path, attribute name) slots."""

    def __init__(self, model: nn.Module):
        self._modules: dict[int, list[str]] = defaultdict(list)
        self._parameters: dict[int, list[str]] = defaultdict(list)
        for path, module in model.named_modules():
            prefix = f"{path}." if path else ""
            for name, child in module._modules.items():
                if child is not None:
                    self._modules[id(child)].append(prefix + name)
            for name, parameter in module._parameters.items():
                if parameter is not None:
                    self._parameters[id(parameter)].append(prefix + name)

    def refusal(self, kind: str, module: nn.Module, children: tuple[str, ...]) -> Refusal | None:
        """Why a ``kind`` fusion that rebuilds ``children`` of ``module`` (their places and tensors;
        ``""``: the module's own place) would split something the model shares; None when nothing is."""
        for child in children:
            target = module.get_submodule(child) if child else module
            places = self._modules.get(id(target), [])
            if len(places) > 1:
                return Refusal(
                    f"{kind}.shared-module",
                    f"the module at {places[0]} is also at {', '.join(places[1:])}; fusing it at one place "
                    "would part it from the others, so it is left as it is.",
                )
            for parameter in target.parameters() if child else ():
                names = self._parameters.get(id(parameter), [])
                if len(names) > 1:
                    return Refusal(
                        f"{kind}.shared-weight",
                        f"{names[0]} is also {', '.join(names[1:])}; merging would copy it and untie them, "
                        "so it is left as it is.",
                    )
        return None
