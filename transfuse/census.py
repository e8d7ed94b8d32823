"""No silent skip: an independent count of fusion opportunities, and a refusal for each one a
rewrite neither fused nor refused.

The count knows nothing of the fusers' matchers. It reads each module's structure and its class's
forward source (``ast``, once per class; no forward pass, no trace):

- ``rms_norm``: a module without children holding at most one parameter, 1-D, whose forward takes a
  square root (``rsqrt``, ``sqrt``, ``** -0.5``) and a mean, and subtracts no mean (a LayerNorm);
  and ``torch.nn.RMSNorm``;
- ``qkv`` / ``gate_up``: two or more ``nn.Linear`` children called in the forward on the same value
  (the same expression, no assignment to its names between the calls); a pair whose results are
  multiplied (directly or through one call, an activation) is a ``gate_up``, any other set a ``qkv``;
  the methods of the class the forward calls through ``self`` are read the same way, each on its own
  (a forward split into helpers: ``self.heads(x)`` projecting q, k and v);
- ``moe``: a module holding a ``ModuleList`` of two or more modules of one class with two or more
  ``nn.Linear`` children each (expert MLPs), or a parameter of three dimensions (stacked experts; not
  a convolution of ``torch.nn``), beside a router: a 2-D weight with one row per expert outside the
  experts, in the module or its parent, or ``topk`` in a forward; or a module whose forward adds
  rows into a tensor (``index_add``) in a ``for`` loop, with ``topk`` in the forward of the module,
  its parent or a child of its parent (experts held in any other shape);
- ``rotary``: each call in the forward of a module-level function whose body multiplies by values
  named ``cos`` and ``sin``, calls a function named ``rotate*``, or uses ``view_as_complex`` or
  ``polar`` (one level of calls followed); such calls in the methods of the class the forward
  calls (``self._projections_and_rope(...)``, a forward split in two); and calls of a static method
  of the class that is itself such a function (``self.apply_rotary(...)``).

Modules whose class's forward already calls transfuse (a rewritten instance, a class of an emitted
modeling file), and what they hold, are left out: transfuse's own work. After a rewrite, ``account`` gives each counted structure that no fusion covers and no refusal names
(of its kind, at its module or for its class; a projection counts with either projection kind, and
inside the experts of a fused mixture, which computes it; a mixture with its module's parent,
grandparent or children) a refusal tagged ``<kind>.unrecognised-form``, so the
report shows it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass

from torch import nn

from .rewriter.apply import is_fused
from .rewriter.report import RewriteReport, SkipRecord
from .rewriter.standalone import RUNTIME_MODULE
from .rewriter.tracer import unwrapped_forward

__all__ = ["KINDS", "Opportunity", "absorbed", "account", "count", "fused", "unaccounted"]

KINDS = ("rms_norm", "qkv", "gate_up", "moe", "rotary")
_PROJECTIONS = ("qkv", "gate_up")
# A fusion of these kinds at a norm's place covers it (the residual add fused with the norm).
_NORM_KINDS = ("rms_norm", "add_rms_norm")


@dataclass(frozen=True)
class Opportunity:
    """One structure the count found: of ``kind``, at module ``path`` (of class ``cls``); ``detail``
    names it (the children, the function called)."""

    kind: str
    path: str
    cls: str
    detail: str = ""
    parent_cls: str = ""  # the class of the module holding it (a mixture's block holds its experts)
    grandparent_cls: str = ""  # and of the module holding that (a block whose experts child holds grouped GEMMs)

    def describe(self) -> str:
        return f"{self.kind}:{self.path or '<model>'}{':' + self.detail if self.detail else ''}"


def count(model: nn.Module) -> list[Opportunity]:
    """Every opportunity in ``model`` (modules transfuse already fused are left out)."""
    found: list[Opportunity] = []
    skip: list[str] = []
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if is_fused(module) or _calls_transfuse(type(module)):
            skip.append(path)  # transfuse's own work (a rewritten or emitted class), and what it holds
            continue
        parent = path.rpartition(".")[0] if path else None
        grandparent = parent.rpartition(".")[0] if parent else None
        found += _of_module(path, module, modules.get(parent), modules.get(grandparent))
    return found


@functools.lru_cache(maxsize=4096)
def _calls_transfuse(cls: type) -> bool:
    """The class's forward reads something of transfuse's (an op, or the runtime an emitted file imports)."""
    if cls.forward is nn.Module.forward:
        return False
    tree, namespace = _forward_tree(cls)
    if tree is None:
        return False
    for name in _names(tree):
        origin = getattr(namespace.get(name), "__module__", None) or ""
        if origin.split(".")[0] == "transfuse" or origin.rpartition(".")[2] == RUNTIME_MODULE:
            return True
    return False


def _of_module(path: str, module: nn.Module, parent: nn.Module | None, grandparent: nn.Module | None = None) -> list[Opportunity]:
    cls = type(module).__name__
    found = []
    if _norm_like(module):
        found.append(Opportunity("rms_norm", path, cls))
    if _holds_experts(module, parent):
        found.append(Opportunity(
            "moe", path, cls, parent_cls=type(parent).__name__ if parent is not None else "",
            grandparent_cls=type(grandparent).__name__ if grandparent is not None else "",
        ))  # fmt: skip
    linears = {name for name, child in module.named_children() if isinstance(child, nn.Linear)}
    if len(linears) >= 2:
        for kind, names in _shared_inputs(type(module), frozenset(linears)):
            found.append(Opportunity(kind, path, cls, "+".join(names)))
    for name in _rotary_calls(type(module)):
        found.append(Opportunity("rotary", path, cls, name))
    return found


def _forward_tree(cls: type) -> tuple[ast.FunctionDef | None, dict]:
    """The class's forward, parsed, and the globals it reads (None where its source cannot be read)."""
    return _parsed(unwrapped_forward(cls))


@functools.lru_cache(maxsize=4096)
def _own_code(cls: type) -> tuple[tuple[ast.FunctionDef, dict], ...]:
    """The forward, parsed, and each method of the class it calls through ``self`` (and those call
    in turn), each once: a forward split into helpers is read whole. Static methods are not
    followed (they are functions of their arguments, read where they are called)."""
    tree, namespace = _forward_tree(cls)
    found, seen = [], {"forward"}
    todo = [(tree, namespace)] if tree is not None else []
    while todo:
        found.append(todo.pop(0))
        for node in ast.walk(found[-1][0]):
            name = _self_method(node.func) if isinstance(node, ast.Call) else None
            if name is None or name in seen or _is_static(cls, name):
                continue
            seen.add(name)
            method = getattr(cls, name, None)
            if isinstance(method, types.FunctionType):  # not a child module or an attribute of the instance
                method_tree, method_namespace = _parsed(method)
                if method_tree is not None:
                    todo.append((method_tree, method_namespace))
    return tuple(found)


def _self_method(func: ast.AST) -> str | None:
    """``name`` for ``self.name`` (a method of the class, or a child module: looked up on the class)."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return func.attr
    return None


def _is_static(cls: type, name: str) -> bool:
    return isinstance(inspect.getattr_static(cls, name, None), staticmethod)


@functools.lru_cache(maxsize=4096)
def _parsed(function) -> tuple[ast.FunctionDef | None, dict]:
    function = inspect.unwrap(function)
    if not isinstance(function, types.FunctionType):
        return None, {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None, {}
    node = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    return node, function.__globals__


def _names(node: ast.AST) -> set[str]:
    """Identifiers and attribute names read anywhere in ``node``."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


# --- norms


def _norm_like(module: nn.Module) -> bool:
    if isinstance(module, nn.RMSNorm):
        return True
    params = list(module.parameters(recurse=False))
    if list(module.children()) or len(params) > 1 or (params and params[0].dim() != 1):
        return False
    if type(module).forward is nn.Module.forward or type(module).__module__.startswith("torch."):
        return False
    tree, _ = _forward_tree(type(module))
    if tree is None:
        return False
    names = _names(tree)
    root = bool(names & {"rsqrt", "sqrt"}) or any(
        isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) and _is_constant(n.right, -0.5) for n in ast.walk(tree)
    )
    return root and "mean" in names and not _subtracts_a_mean(tree)


def _subtracts_a_mean(tree: ast.AST) -> bool:
    """``x - x.mean(...)`` or ``x - mean`` with ``mean = x.mean(...)``: a LayerNorm, not a root mean square."""
    means = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and "mean" in _names(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            right = _names(node.right)
            if "mean" in right and any(isinstance(n, ast.Call) for n in ast.walk(node.right)):
                return True
            if isinstance(node.right, ast.Name) and node.right.id in means:
                return True
    return False


def _is_constant(node: ast.AST, value: float) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return isinstance(node.operand, ast.Constant) and node.operand.value == -value
    return isinstance(node, ast.Constant) and node.value == value


# --- mixtures


def _holds_experts(module: nn.Module, parent: nn.Module | None) -> bool:
    """Experts beside a router: stacked expert weights (a 3-D parameter) or a list of expert MLPs,
    with a router in the module or its parent (a 2-D weight with one row per expert, outside the
    experts, or ``topk`` in a forward). A list of layers or a block-diagonal weight is not a mixture."""
    if type(module).__module__.startswith("torch."):
        return False  # a convolution's weight is 3-D too
    own = {id(p) for p in module.parameters(recurse=False)}
    for p in module.parameters(recurse=False):
        if p.dim() == 3 and any(_routes(h, p.shape[0], own) for h in (module, parent) if h is not None):
            return True
    for child in module.children():
        if isinstance(child, nn.ModuleList) and len(child) >= 2 and len({type(c) for c in child}) == 1:
            if sum(isinstance(g, nn.Linear) for g in child[0].children()) >= 2:
                if _routes(module, len(child), {id(p) for p in child.parameters()}):
                    return True
    if _adds_rows_in_loop(type(module)):
        near = (module, *((parent, *parent.children()) if parent is not None else ()))
        return any("topk" in _names(tree) for tree in (_forward_tree(type(h))[0] for h in near) if tree is not None)
    return False


@functools.lru_cache(maxsize=4096)
def _adds_rows_in_loop(cls: type) -> bool:
    """The class's forward calls ``index_add`` (or ``index_add_``) inside a ``for`` loop."""
    if cls.forward is nn.Module.forward:
        return False
    tree, _ = _forward_tree(cls)
    if tree is None:
        return False
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For)]
    return any(_names(loop) & {"index_add", "index_add_"} for loop in loops)


def _routes(holder: nn.Module, experts: int, experts_own: set[int]) -> bool:
    for p in holder.parameters():
        if p.dim() == 2 and p.shape[0] == experts and id(p) not in experts_own:
            return True
    tree, _ = _forward_tree(type(holder))
    return tree is not None and "topk" in _names(tree)


# --- projections


def _self_call(node: ast.AST, linears: frozenset) -> str | None:
    """``name`` where ``node`` is ``self.<name>(...)`` of one of ``linears``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in linears:
        if isinstance(node.func.value, ast.Name) and node.func.value.id == "self" and node.args:
            return node.func.attr
    return None


@functools.lru_cache(maxsize=4096)
def _shared_inputs(cls: type, linears: frozenset) -> tuple[tuple[str, tuple[str, ...]], ...]:
    found = {group for tree, _ in _own_code(cls) for group in _shared_inputs_in(tree, linears)}
    return tuple(sorted(found))


def _shared_inputs_in(tree: ast.FunctionDef, linears: frozenset) -> list[tuple[str, tuple[str, ...]]]:
    assigned = _assignments(tree)
    groups: dict[tuple, set[str]] = {}
    for node in ast.walk(tree):
        name = _self_call(node, linears)
        if name is None:
            continue
        argument = node.args[0]
        versions = tuple(sorted((n, sum(line < node.lineno for line in assigned.get(n, ()))) for n in _names(argument)))
        groups.setdefault((ast.dump(argument), versions), set()).add(name)
    results = _results(tree, linears)
    found = []
    for names in {frozenset(g) for g in groups.values() if len(g) >= 2}:
        ordered = tuple(sorted(names))
        glu = len(names) == 2 and _multiplied(tree, ordered, results)
        found.append(("gate_up" if glu else "qkv", ordered))
    return found


def _assignments(tree: ast.AST) -> dict[str, list[int]]:
    """name -> the lines assigning it."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.NamedExpr)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    found.setdefault(sub.id, []).append(node.lineno)
    return found


def _results(tree: ast.AST, linears: frozenset) -> dict[str, str]:
    """Variable -> the linear child whose result was assigned to it (``g = self.gate(x)``)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            called = {_self_call(n, linears) for n in ast.walk(node.value)} - {None}
            if len(called) == 1:
                found[node.targets[0].id] = called.pop()
    return found


def _reaches(node: ast.AST, results: dict[str, str], linears: frozenset) -> set[str]:
    reached = {_self_call(n, linears) for n in ast.walk(node)} - {None}
    return reached | {results[n.id] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in results}


def _multiplied(tree: ast.AST, pair: tuple[str, ...], results: dict[str, str]) -> bool:
    linears = frozenset(pair)
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            left, right = _reaches(node.left, results, linears), _reaches(node.right, results, linears)
            if (left, right) in ((set(pair[:1]), set(pair[1:])), (set(pair[1:]), set(pair[:1]))):
                return True
    return False


# --- rotary


@functools.lru_cache(maxsize=4096)
def _rotary_calls(cls: type) -> tuple[str, ...]:
    """The calls of module-level rotary functions in the forward and the methods it calls, and the
    calls of static methods that are such functions (by function name, one per call)."""
    if cls.forward is nn.Module.forward:
        return ()
    calls = []
    for tree, namespace in _own_code(cls):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name):
                function = namespace.get(node.func.id)
                if isinstance(function, types.FunctionType) and _rotates(function, depth=1):
                    calls.append(node.func.id)
            elif (name := _self_method(node.func)) is not None and _is_static(cls, name):
                if _rotates(getattr(cls, name), depth=1):
                    calls.append(name)
    return tuple(calls)


def _rotates(function, depth: int) -> bool:
    tree, namespace = _parsed(function)
    if tree is None:
        return False
    names = _names(tree)
    if names & {"view_as_complex", "polar"} or any(n.startswith("rotate") for n in names):
        return True
    products = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)]
    multiplied = set().union(*(_names(n.left) | _names(n.right) for n in products)) if products else set()
    if any("cos" in n for n in multiplied) and any("sin" in n for n in multiplied):
        return True
    if depth > 0:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called = namespace.get(node.func.id)
                if isinstance(called, types.FunctionType) and called is not function and _rotates(called, depth - 1):
                    return True
    return False


# --- the rule


def unaccounted(found: list[Opportunity], report: RewriteReport, kinds=KINDS) -> list[Opportunity]:
    """The opportunities of ``kinds`` in ``found`` that ``report`` neither fused nor refused."""
    return [o for o in found if o.kind in kinds and not _accounted(o, report)]


def _covering(kind: str) -> tuple[str, ...]:
    if kind in _PROJECTIONS:
        return _PROJECTIONS
    return _NORM_KINDS if kind == "rms_norm" else (kind,)


def _places(o: Opportunity) -> set[str]:
    """The module paths where a record of this opportunity may sit."""
    places = {o.path}
    if o.kind in ("moe", "rms_norm"):
        places.add(o.path.rpartition(".")[0])  # a mixture's block; a norm fused with the add before it
    if o.kind == "moe" and "." in o.path:
        places.add(o.path.rpartition(".")[0].rpartition(".")[0])  # the block of an experts child's grouped GEMMs
    return places


def _accounted(o: Opportunity, report: RewriteReport) -> bool:
    return fused(o, report) or _refused(o, report)


def fused(o: Opportunity, report: RewriteReport) -> bool:
    """Whether a fusion in ``report`` covers ``o``."""
    if absorbed(o, report):
        return True
    kinds, places = _covering(o.kind), _places(o)
    for f in report.fusions:
        if f.kind not in kinds:
            continue
        if f.path == o.path or (o.kind == "moe" and (f.path in places or f.path.startswith(o.path + "."))):
            return True
        if f.path in places and _child(f.path, o.path) in f.replaced:
            return True
    return False


def absorbed(o: Opportunity, report: RewriteReport) -> bool:
    """A projection inside a module that a fused mixture of experts computes in full (its experts):
    an expert's gate and up projections are parts of the fused op's one gate/up projection, its
    activation and product the op's own."""
    if o.kind not in _PROJECTIONS:
        return False
    for f in report.fusions:
        if f.kind == "moe":
            for child in f.claimed:
                place = f"{f.path}.{child}" if f.path else child
                if o.path == place or o.path.startswith(place + "."):
                    return True
    return False


def _refused(o: Opportunity, report: RewriteReport) -> bool:
    kinds = _PROJECTIONS if o.kind in _PROJECTIONS else (o.kind,)
    places = _places(o) if o.kind == "moe" else {o.path}
    for s in report.skipped:
        if s.kind not in kinds:
            continue
        if s.path is not None and (s.path in places or (o.kind == "moe" and s.path.startswith(o.path + "."))):
            return True
        if s.path is None and (s.cls == o.cls or (o.kind == "moe" and s.cls in {o.parent_cls, o.grandparent_cls} - {""})):
            return True  # a refusal of the class (a mixture's: of the block holding the experts, or their holder)
    return False


def _child(parent: str, path: str) -> str:
    return path[len(parent) + 1 :] if parent else path


def account(found: list[Opportunity], report: RewriteReport, kinds=KINDS) -> list[Opportunity]:
    """A refusal in ``report`` for each unaccounted opportunity (``<kind>.unrecognised-form``); returns them."""
    missing = unaccounted(found, report, kinds)
    for o in missing:
        what = f" ({o.detail})" if o.detail else ""
        reason = (
            f"the structure of a {o.kind} fusion is here{what}, found by counting the module's structure and "
            "forward source, but no fuser recognised its form; it runs as written."
        )
        report.add_skip(SkipRecord(o.cls, o.kind, reason, f"{o.kind}.unrecognised-form", path=o.path))
    return missing
