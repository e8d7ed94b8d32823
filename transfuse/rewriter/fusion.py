"""The contract between the rewriter and the fusers.

A fuser answers three questions. ``match``: does this class match? (class level, once,
from the traced graph; the answer is cached). ``validate``: does this instance fit?
(shapes, dtypes, attribute values). ``fuse``: build the new submodules from the
instance's own tensors and say what changed. The rewriter does the rest: which classes
to trace, applying, verifying, undoing and reporting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, TypeVar

from torch import nn

if TYPE_CHECKING:
    import libcst as cst

    from .analysis import ClassAnalysis
    from .source import EditContext

__all__ = ["Fused", "Fuser", "Refusal", "SourceFuser"]

# The record a fuser's ``match`` returns for a class: names and flags found, never instance values.
M = TypeVar("M")


@dataclass(frozen=True)
class Refusal:
    """Why a fusion was not made: a stable tag (``rms_norm.gated``), one sentence, and where."""

    tag: str
    reason: str
    where: str | None = None


@dataclass
class Fused:
    """What ``Fuser.fuse`` changed.

    replacement: a module that takes the instance's place in its parent (or None when
        the instance was changed in place).
    replaced: names of the replaced children, or ``("",)`` for the instance itself.
    into: class name of the new module.
    undo: puts the instance back as it was (in-place fusions only; a replacement is
        undone by putting the original module back).
    """

    replaced: tuple[str, ...]
    into: str
    replacement: nn.Module | None = None
    undo: Callable[[], None] | None = None


class Fuser(ABC, Generic[M]):
    """One fusion pattern, whose ``match`` finds an ``M`` in a class. Subclasses set ``kind`` and
    implement ``match`` and ``fuse``; every other hook is given that record as ``found``."""

    kind: ClassVar[str]
    # True when ``fuse`` returns a replacement for the whole instance (its children go with it).
    replaces_module: ClassVar[bool] = False
    # Applied only when asked for by kind (it changes what the model returns); a rewrite without it
    # says in its report where it would apply (``suggestion``).
    opt_in: ClassVar[bool] = False
    # The fusion changes what runs in training mode only: the rewrite checks the model's loss in
    # training mode too.
    changes_training: ClassVar[bool] = False
    # Kinds this one builds on: asking for it without them is an error (``fusers_for``).
    requires: ClassVar[tuple[str, ...]] = ()

    def wants(self, module: nn.Module) -> bool:
        """Cheap class-level filter: is it worth tracing this module's class for this pattern?"""
        return True

    def claimed_children(self, found: M) -> tuple[str, ...]:
        """Children (dotted names) of a planned instance that this fusion consumes, so that no
        other fusion plans anything in them. A fuser that replaces the module claims all."""
        return ()

    def rebuilt_children(self, found: M) -> tuple[str, ...]:
        """Children (dotted names) whose places ``fuse`` takes and whose tensors it copies into new ones,
        and ``""`` where it takes the instance's own place (its parameters reused): the rewriter refuses
        the fusion where one of them is shared with another place in the model (``sharing``)."""
        return ("",) if self.replaces_module else ()

    @abstractmethod
    def match(self, analysis: ClassAnalysis) -> M | Refusal | None:
        """What was found in the class (a record of names and flags, never instance values),
        a Refusal for a class that looks like the pattern but cannot be fused, or None."""

    def validate(self, module: nn.Module, found: M) -> Refusal | None:
        """Whether this instance fits what was found in its class."""
        return None

    def suggestion(self, module: nn.Module, found: M) -> str:
        """For an opt-in fuser that was not asked for: what the report says it would do here."""
        return ""

    def emitted_forward(self, found: Any, context: EditContext) -> cst.FunctionDef | None:
        """For a fuser that replaces modules: the forward an emitted modeling file gives the
        original class instead (calling the same fused op), or None if it cannot emit one.
        ``found`` is what ``emission`` kept; statements the class needs besides the forward go
        in ``context.class_statements``."""
        return None

    def emission(self, found: M, fused: Fused) -> Any:
        """What ``emitted_forward`` needs of a replacement, kept on the model (so it must deep-copy
        and pickle: no graph nodes); None where there is nothing to emit. Default: the match."""
        return found

    @abstractmethod
    def fuse(self, module: nn.Module, found: M) -> Fused:
        """Build the fused module(s) from the instance's own tensors."""


class SourceFuser(Fuser[M]):
    """A fuser that edits the class's forward source (once per class) and, per instance,
    changes the instance's children in place; the rewriter binds the edited forward.

    ``edit`` must re-prove on the syntax tree whatever the (possibly partial) graph could
    not show, and raise ``NoMatch`` otherwise. Several source fusers may edit one class:
    their edits compose, each on the output of the previous one.
    """

    @abstractmethod
    def edit(self, tree: cst.FunctionDef, found: M, context: EditContext) -> cst.FunctionDef:
        """The forward with this fusion's change made."""

    @abstractmethod
    def declaration(self, found: M) -> Any:
        """What an emitted modeling file declares on the class so that loading builds the fused
        children (a ``rewriter.weights.Merge``); ``fuse`` builds the same at run time."""
