"""Whether calling a module would run hooks, and carrying a module's hooks over to another.

A fused layer computes what several modules of the original computed without calling them. Where
one of those modules has hooks (forward, forward-pre, backward; its own or global ones), the layer
calls it as the original did instead, so the hooks run with the same inputs and outputs, as often,
and a hook that changes an output changes it. The checks are dict truthiness only: they run on
every call, and under ``torch.compile`` they are guards, not graph breaks.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as module_globals

__all__ = ["HOOK_TABLES", "global_hooks", "hooked", "watched", "share_hooks"]

# An nn.Module's own hook tables (and the flag of its backward hooks' kind), which ``share_hooks``
# hands to the module that takes its place.
HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own that its call runs."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def global_hooks() -> bool:
    """Whether hooks registered for every module (``register_module_forward_hook``, ...) exist."""
    return bool(
        module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks
        or module_globals._global_backward_hooks
        or module_globals._global_backward_pre_hooks
    )


def watched(module: nn.Module) -> bool:
    """Whether a call of ``module`` would run any hook, its own or a global one."""
    return hooked(module) or global_hooks()


def share_hooks(source: nn.Module, target: nn.Module) -> None:
    """``target`` runs ``source``'s hooks from now on: it takes the same hook tables (not copies), so
    handles returned when they were registered still remove them, and hooks registered on either
    one are the other's too (the original module keeps them when a fusion is undone)."""
    for name in HOOK_TABLES:
        if name in source.__dict__:
            target.__dict__[name] = source.__dict__[name]
