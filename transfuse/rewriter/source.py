"""The libcst source layer: one transformation of a class's method, three outputs.

A traced graph is evidence of what ran for one input. What it cannot show (a branch not
taken, a name rebound, a second use) is proved here on the syntax tree before an edit
is made. The edited method is the single source of truth for:

* the runtime rewrite: compiled against the original module's globals (read live, never
  added to: the names an edit needs are closure cells), under the original file name and
  line numbers (tracebacks point at real code), inside a shell of the original class so
  that decorators, ``__qualname__`` and zero-argument ``super()`` behave as in the original,
  and bound to each instance inside the wrappers its class puts around its forward (``wrappers``);
* the emitted modeling file: the original file with the method replaced, formatting
  and comments kept;
* the diff between the two texts.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import functools
import importlib
import inspect
import os
import pickle
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import libcst as cst
import libcst.matchers as m
import torch
from libcst.metadata import MetadataWrapper, PositionProvider

from .graph import NoMatch
from .wrappers import rewrapped

__all__ = [
    "forward_replaced",
    "EditContext",
    "MethodRewrite",
    "MethodSource",
    "PicklesRewritten",
    "bind",
    "control_flow",
    "helper_functions",
    "method_source",
    "rebuilt_rewrite",
    "rewrite_method",
    "rewrite_of",
    "self_calls",
    "self_method_calls",
    "unbind",
]


@dataclass(frozen=True)
class ParsedFile:
    filename: str
    text: str
    module: cst.Module
    positions: dict  # node -> CodeRange
    functions: dict  # (name, line of `def`) -> FunctionDef


@functools.lru_cache(maxsize=64)
def _parse_file(filename: str) -> ParsedFile | None:
    try:
        with open(filename, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    functions = {
        (node.name.value, positions[node].start.line): node for node in positions if isinstance(node, cst.FunctionDef)
    }
    return ParsedFile(filename, text, wrapper.module, positions, functions)


@dataclass(frozen=True)
class MethodSource:
    """A method's syntax tree in its real file."""

    file: ParsedFile
    node: cst.FunctionDef
    function: Callable  # the unwrapped function object

    @property
    def filename(self) -> str:
        return self.file.filename

    def line(self, node: cst.CSTNode | None = None) -> int:
        return self.file.positions[node if node is not None else self.node].start.line


def method_source(fn: Callable) -> MethodSource | None:
    """The FunctionDef of ``fn`` (unwrapped) in its source file, or None without a source file."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    try:
        filename = inspect.getsourcefile(fn)
    except TypeError:
        return None
    parsed = _parse_file(filename) if filename else None
    if parsed is None:
        return None
    first = code.co_firstlineno  # the first decorator's line, or the `def` line
    for (name, def_line), node in parsed.functions.items():  # libcst's range starts at `def`
        if name == fn.__name__:
            top = parsed.positions[node.decorators[0]].start.line if node.decorators else def_line
            if top <= first <= def_line:
                return MethodSource(parsed, node, fn)
    return None


_CONTROL_FLOW = m.If() | m.For() | m.While() | m.Try() | m.With() | m.IfExp() | m.Match() | m.Return()


def control_flow(source: MethodSource) -> list[tuple[str, int]]:
    """Branches, loops, ``with`` and ``try`` blocks in a method, and returns before its last statement."""
    body = source.node.body.body
    found = []
    for node in m.findall(source.node, _CONTROL_FLOW):
        if isinstance(node, cst.Return) and body and _is_last_return(node, body[-1]):
            continue
        found.append((type(node).__name__.lower(), source.line(node)))
    return found


def _is_last_return(node: cst.Return, last: cst.BaseStatement) -> bool:
    return isinstance(last, cst.SimpleStatementLine) and node in last.body


def self_method_calls(source: MethodSource) -> set[str]:
    """Names ``n`` of calls written ``self.n(...)`` in a method."""
    calls = m.findall(source.node, m.Call(func=m.Attribute(value=m.Name("self"))))
    return {c.func.attr.value for c in calls}


_TORCH_DIR = os.path.dirname(torch.__file__)


def _dotted(node: cst.BaseExpression) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for any other expression."""
    if isinstance(node, cst.Name):
        return [node.value]
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return base + [node.attr.value] if base is not None else None
    return None


def helper_functions(source: MethodSource) -> list[Callable]:
    """Python functions a method calls by a global name (``helper(x)``, ``utils.helper(x)``), as its
    module's globals resolve them now: the model's own code, not torch's, whose control flow
    counts as the method's."""
    found = []
    globals_ = source.function.__globals__
    for call in m.findall(source.node, m.Call()):
        path = _dotted(call.func)
        if path is None or path[0] == "self" or path[0] not in globals_:
            continue
        target = globals_[path[0]]
        for attr in path[1:]:
            target = getattr(target, attr, None)
        target = inspect.unwrap(target) if callable(target) else None
        if not isinstance(target, types.FunctionType):
            continue
        filename = target.__code__.co_filename
        if filename.startswith(_TORCH_DIR) or target in found:
            continue
        found.append(target)
    return found


def self_calls(tree: cst.CSTNode, name: str) -> list[cst.Call]:
    """Calls written ``self.<name>(...)`` in ``tree``."""
    return list(m.findall(tree, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(name)))))


def self_references(tree: cst.CSTNode, name: str) -> list[cst.Attribute]:
    """Every ``self.<name>`` in ``tree``, called or not."""
    return list(m.findall(tree, m.Attribute(value=m.Name("self"), attr=m.Name(name))))


# -- editing ------------------------------------------------------------------------------


@dataclass
class EditContext:
    """What an edit may ask of the rewriter: fresh local names, imports, the class's other code."""

    cls: type
    source: MethodSource
    names: set[str]
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # alias -> (module, name)
    # Statements an emitted forward needs on its class (placed before the method): a plan, say.
    class_statements: list = field(default_factory=list)
    # What the report should say of an edit beyond its kind (the branch a forward was specialised on).
    notes: list[str] = field(default_factory=list)

    def fresh_name(self, base: str) -> str:
        """A local name not used anywhere in the method (nor a builtin)."""
        name, i = base, 1
        while name in self.names or hasattr(builtins, name):
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def require(self, module: str, name: str) -> str:
        """A name under which ``module.name`` is available to the method; recorded as an import."""
        for alias, target in self.imports.items():
            if target == (module, name):
                return alias
        alias = name
        globals_ = self.source.function.__globals__
        while alias in self.names or (alias in globals_ and globals_[alias] is not _resolve(module, name)):
            alias = f"_transfuse_{alias}"
        self.names.add(alias)
        self.imports[alias] = (module, name)
        return alias

    def rebinds_elsewhere(self, attr: str) -> int | None:
        """Line of another method of the class (or its bases in source), ``__init__`` aside, that
        rebinds ``self.<attr>`` or an attribute under it (``self.q_proj = prune(self.q_proj)``,
        ``self.q_proj.weight = ...``, ``del self.q_proj``), else None. A method that only reads it
        (calls it, slices its weight: a base class's forward that a subclass's forward falls back
        to) is no obstacle to merging it: the merge leaves under that name a part that computes what
        the original did, over views of the merged weight."""
        for klass in self.cls.__mro__:
            for key, value in vars(klass).items():
                fn = inspect.unwrap(value) if callable(value) else None
                if fn is None or fn is self.source.function or not hasattr(fn, "__code__") or key == "__init__":
                    continue
                if attr not in fn.__code__.co_names:
                    continue
                other = method_source(fn)
                if other is not None and _writes(other.node, attr):
                    return other.line()
        return None


def _writes(tree: cst.CSTNode, attr: str) -> bool:
    """Whether ``tree`` assigns or deletes ``self.<attr>`` or anything under it."""
    targets = [t.target for t in m.findall(tree, m.AssignTarget() | m.AugAssign() | m.AnnAssign() | m.Del())]
    targets += [e.value for t in targets if isinstance(t, (cst.Tuple, cst.List)) for e in t.elements]
    for written in targets:
        while isinstance(written, (cst.Attribute, cst.Subscript)):
            if m.matches(written, m.Attribute(value=m.Name("self"), attr=m.Name(attr))):
                return True
            written = written.value
    return False


def _resolve(module: str, name: str):
    return getattr(importlib.import_module(module), name)


Edit = Callable[[cst.FunctionDef, EditContext], cst.FunctionDef]


class _MethodReplacer(cst.CSTTransformer):
    """Replaces methods, found by node identity, with their replacements."""

    def __init__(self, replacements: dict[int, cst.CSTNode | cst.FlattenSentinel]):
        self.replacements = replacements

    def leave_FunctionDef(self, original_node, updated_node):
        return self.replacements.get(id(original_node), updated_node)


@dataclass
class MethodRewrite:
    """A class's method after a sequence of edits, and its three outputs."""

    cls: type
    original: MethodSource
    edited: cst.FunctionDef
    imports: dict[str, tuple[str, str]]
    kinds: tuple[str, ...]
    # What an emitted file declares on the class (rewriter.weights.Merge), set by the rewriter.
    declarations: tuple = ()
    # How to make this rewrite again: ((fuser, found), ...), set by the rewriter. A rewrite pickles
    # as its class and recipe, and is made again when unpickled (in another process too).
    recipe: tuple = ()
    # Class-level statements placed before the method in the emitted file (emitted replacements only).
    preceding: tuple = ()
    # The edits' notes for the report (``EditContext.notes``).
    notes: tuple = ()
    _compiled: Callable | None = None
    _bound: dict = field(default_factory=dict)  # class -> what ``bind`` binds for its instances

    def __reduce__(self):
        if not self.recipe:
            raise TypeError(f"This rewrite of {self.cls.__qualname__} has no recipe to be pickled with.")
        return (rebuilt_rewrite, (self.cls, self.recipe))

    def __deepcopy__(self, memo):
        return self  # the same class and edits: nothing of it belongs to one instance

    @property
    def method_name(self) -> str:
        return self.original.node.name.value

    @property
    def defining_class(self) -> type:
        for klass in self.cls.__mro__:
            value = vars(klass).get(self.method_name)
            if value is not None and inspect.unwrap(value) is self.original.function:
                return klass
        return self.cls

    def edited_file_text(self) -> str:
        """The original file with this method replaced (formatting and comments kept)."""
        return self.original.file.module.visit(_MethodReplacer({id(self.original.node): self.replacement})).code

    @property
    def replacement(self) -> cst.FunctionDef | cst.FlattenSentinel:
        """What takes the original method's place in a file: the edited method, after the class
        statements it needs."""
        if not self.preceding:
            return self.edited
        return cst.FlattenSentinel([*self.preceding, self.edited])

    def diff(self, context: int = 3) -> str:
        """Unified diff of the original file against the rewritten one, with real line numbers."""
        name = self.original.filename
        return "".join(
            difflib.unified_diff(
                self.original.file.text.splitlines(keepends=True),
                self.edited_file_text().splitlines(keepends=True),
                fromfile=f"{name}",
                tofile=f"{name} (transfuse: {', '.join(self.kinds)})",
                n=context,
            )
        )

    def compile(self) -> Callable:
        """The edited method as a function in the original module's globals (decorators applied)."""
        if self._compiled is None:
            self._compiled = _compile(self)
        return self._compiled

    def forward_for(self, cls: type) -> Callable:
        """The function ``bind`` binds to instances of ``cls``: the compiled method inside the wrappers
        ``cls`` has around the original one (``wrappers``); NoMatch where they cannot be copied."""
        if cls not in self._bound:
            self._bound[cls] = _follower(self, cls, rewrapped(cls, self.method_name, self.original.function, self.compile()))
        return self._bound[cls]


_REBUILT: dict = {}


def rebuilt_rewrite(cls: type, recipe: tuple) -> MethodRewrite:
    """The rewrite ``recipe`` ((fuser, found), ...) makes of ``cls.forward``: unpickling a rewritten
    instance runs the same edits on the class's source again (once per process)."""
    key = _recipe_key(cls, recipe)
    if key not in _REBUILT:
        from .tracer import unwrapped_forward

        edits = [(fuser.kind, functools.partial(_fuser_edit, fuser, found)) for fuser, found in recipe]
        rewrite, refusals = rewrite_method(cls, unwrapped_forward(cls), edits)
        if rewrite is None or refusals:
            reasons = "; ".join(f"{kind}: {r.reason}" for kind, r in refusals.items())
            raise RuntimeError(
                f"The rewrite of {cls.__qualname__} could not be made again here ({reasons or 'no edit applied'}): "
                "is this the transformers version the model was rewritten with?"
            )
        rewrite.recipe = recipe
        rewrite.declarations = tuple(d for d in (f.declaration(found) for f, found in recipe) if d is not None)
        _REBUILT[key] = rewrite
    return _REBUILT[key]


def remember(rewrite: MethodRewrite) -> None:
    """Keep a rewrite made in this process as the one its class and recipe make, so unpickling an
    instance with that rewrite here (a copy, or a compiled call loaded from disk whose guards read
    the model's methods) binds it instead of editing the class's source again."""
    if rewrite.recipe:
        try:
            key = _recipe_key(rewrite.cls, rewrite.recipe)
        except (pickle.PicklingError, AttributeError, TypeError):
            return  # a fuser that cannot be pickled (a class local to a function): nothing to bind by recipe
        _REBUILT.setdefault(key, rewrite)


def _recipe_key(cls: type, recipe: tuple) -> tuple:
    """A recipe as a key: each fuser by its pickled state (an unpickled fuser is another object of
    the same state), each found record as itself (frozen, compared by value)."""
    return (cls, tuple((pickle.dumps(fuser), found) for fuser, found in recipe))


def _fuser_edit(fuser, found, tree, context):
    return fuser.edit(tree, found, context)


# The attribute of a rewrite's compiled function that names the rewrite (``rewrite_of``).
_REWRITE_OF = "_transfuse_rewrite"
# Where a rewritten instance keeps ``PicklesRewritten`` (pickle and copy look it up there first).
_REDUCE_EX = "__reduce_ex__"


def bind(rewrite: MethodRewrite, instance) -> types.MethodType:
    """``rewrite``'s method bound to ``instance``, installed as the instance's ``forward``, inside the
    wrappers the instance's class has around its own forward (``MethodRewrite.forward_for``).

    A plain bound method, because Dynamo guards one by its function, which every instance with
    this rewrite shares: a decoder layer compiled on its own (``layer.compile()``), or a layer
    Dynamo reaches after a graph break, compiles once for all the layers, as the stock model's
    do. An object of transfuse's own there would be guarded by its identity, one recompile per
    layer until Dynamo's recompile limit, and the layers past it eager. A plain bound method
    pickles as a name looked up on the class (the original forward), so the instance also gets
    ``PicklesRewritten`` as its own ``__reduce_ex__``."""
    function = rewrite.forward_for(type(instance))
    instance.__dict__[_REDUCE_EX] = PicklesRewritten(instance)
    return types.MethodType(function, instance)


def _follower(rewrite: MethodRewrite, cls: type, function: Callable) -> Callable:
    """``function`` (the rewrite in ``cls``'s wrappers) for instances of ``cls``; an instance whose class
    changed after the rewrite (FSDP2's ``fully_shard`` makes it an instance of a subclass, which wraps
    the forward again) runs the rewrite in its new class's wrappers instead, as the original would."""

    def forward(self, *args, **kwargs):
        if type(self) is cls:
            return function(self, *args, **kwargs)
        try:
            other = rewrite.forward_for(type(self))
        except NoMatch as refusal:
            raise RuntimeError(
                f"This {type(self).__qualname__} runs a forward rewritten for {cls.__qualname__}, which its new class "
                f"cannot run: {refusal.reason} Rewrite the model after changing the class of its modules."
            ) from None
        return other(self, *args, **kwargs)

    functools.update_wrapper(forward, function)
    setattr(forward, _REWRITE_OF, rewrite)
    return forward


def unbind(instance) -> None:
    """What ``bind`` set on ``instance`` besides the method (the caller puts its forward back)."""
    if isinstance(instance.__dict__.get(_REDUCE_EX), PicklesRewritten):
        del instance.__dict__[_REDUCE_EX]


def forward_replaced(module: nn.Module) -> bool:
    """Whether something other than transfuse replaced the instance's ``forward`` (a parallel plan's
    wrapper, a hook library's): a fusion that stops calling the module would stop calling it too."""
    forward = module.__dict__.get("forward")
    if "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__:
        # accelerate's device hooks wrap the instance's own forward, kept as ``_old_forward``, which
        # the rewrite replaces in their place (``rewriter/apply.py``): only that one matters.
        forward = module.__dict__["_old_forward"]
        if isinstance(forward, types.MethodType) and forward.__func__ is type(module).forward:
            return False
    return forward is not None and rewrite_of(forward) is None


def rewrite_of(method) -> MethodRewrite | None:
    """The rewrite a bound method runs (``bind``), or None."""
    if not isinstance(method, types.MethodType):
        return None
    return getattr(method.__func__, _REWRITE_OF, None)


class PicklesRewritten:
    """A rewritten instance's ``__reduce_ex__``: the instance reduces as usual, except that each
    method ``bind`` bound to it reduces as its rewrite and the instance, so ``copy.deepcopy``
    binds the copy's method and ``torch.load`` binds the loaded one's (in another process too:
    the rewrite is made again from its recipe). It pickles as the instance it serves."""

    __slots__ = ("instance",)

    def __init__(self, instance):
        self.instance = instance

    def __call__(self, protocol: int):
        reduced = object.__reduce_ex__(self.instance, protocol)
        state = reduced[2] if len(reduced) > 2 else None
        if not isinstance(state, dict):
            return reduced
        state = {
            name: _Rebinding(rewrite, self.instance) if (rewrite := rewrite_of(value)) is not None else value
            for name, value in state.items()
        }
        return (*reduced[:2], state, *reduced[3:])

    def __reduce__(self):
        return (PicklesRewritten, (self.instance,))


class _Rebinding:
    """A rewritten method in a reduced state: made again, bound to the copy, when the state is. It
    reduces as the rewrite and, beside it, the rewrite's class and recipe: a pickler that leaves some
    of an instance's attributes out (Dynamo's guard state leaves out those its guards do not read,
    the instance's ``_transfuse_rewrite`` among them, and so the rewrite) still has what the method
    needs."""

    __slots__ = ("rewrite", "instance")

    def __init__(self, rewrite: MethodRewrite, instance):
        self.rewrite, self.instance = rewrite, instance

    def __reduce__(self):
        rewrite = self.rewrite
        return (_bind_again, (rewrite, self.instance, rewrite.cls, rewrite.recipe))


def _bind_again(rewrite: MethodRewrite, instance, cls: type | None = None, recipe: tuple = ()) -> types.MethodType:
    if not isinstance(rewrite, MethodRewrite):  # (left out by the pickler: made from its recipe)
        rewrite = rebuilt_rewrite(cls, recipe)
    return types.MethodType(rewrite.forward_for(type(instance)), instance)


def _method_code(node: cst.FunctionDef) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _line_map(original: MethodSource, edited_code: str) -> list[int]:
    """For each line of the edited method's code, the line of the original file it stands for.

    Unchanged lines keep their line; a changed line takes the most similar original line of
    its block (in order); an inserted line takes the line it was inserted before.
    """
    old_lines = _method_code(original.node).splitlines()
    new_lines = edited_code.splitlines()
    def_index = next(i for i, line in enumerate(old_lines) if line.lstrip().startswith(("def ", "async def ")))
    base = original.line() - def_index  # file line of old_lines[0]
    mapping = [base] * len(new_lines)
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for j in range(b0, b1):
                mapping[j] = base + a0 + (j - b0)
            continue
        floor = a0
        for j in range(b0, b1):
            scores = [(difflib.SequenceMatcher(a=old_lines[i], b=new_lines[j]).ratio(), i) for i in range(floor, a1)]
            best, i = max(scores, default=(0.0, a0), key=lambda s: (s[0], -s[1]))
            if best < 0.6:
                i = min(floor, len(old_lines) - 1)
            mapping[j] = base + i
            floor = i
    return mapping


# The function around the class shell whose parameters carry the names an edit needs.
_FACTORY = "__transfuse_method_factory__"


def _compile(rewrite: MethodRewrite) -> Callable:
    """Compile the edited method in the original module's globals, which it reads live (a later
    patch of the module by another library is seen), without adding anything to them: the names
    the edit needs (``EditContext.require``) are parameters of a function around the class shell,
    so the method reads them from closure cells, which ``torch.compile(fullgraph=True)`` follows."""
    code = _method_code(rewrite.edited)
    tree = ast.parse(code)
    mapping = _line_map(rewrite.original, code)
    for node in ast.walk(tree):
        if hasattr(node, "lineno"):
            node.lineno = mapping[min(node.lineno, len(mapping)) - 1]
            end = mapping[min(node.end_lineno or node.lineno, len(mapping)) - 1]
            if end <= node.lineno:  # a span whose lines map out of order: one line, columns in order
                end = node.lineno
                if getattr(node, "end_col_offset", None) is not None and node.end_col_offset < node.col_offset:
                    node.end_col_offset = node.col_offset
            node.end_lineno = end
    klass = rewrite.defining_class
    # A class shell with the original name: __qualname__, decorators and super() see what they expect.
    shell = ast.ClassDef(name=klass.__name__, bases=[], keywords=[], body=tree.body, decorator_list=[])
    shell.lineno = shell.end_lineno = tree.body[0].lineno
    shell.col_offset = shell.end_col_offset = 0
    aliases = sorted(rewrite.imports)
    factory = ast.FunctionDef(
        name=_FACTORY,
        args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg=a) for a in aliases], kwonlyargs=[], kw_defaults=[], defaults=[]
        ),
        body=[shell, ast.Return(value=ast.Name(id=klass.__name__, ctx=ast.Load()))],
        decorator_list=[],
        returns=None,
        **({"type_params": []} if "type_params" in ast.FunctionDef._fields else {}),
    )
    ast.copy_location(factory, shell)
    module = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))
    namespace: dict = {}
    exec(compile(module, rewrite.original.filename, "exec"), rewrite.original.function.__globals__, namespace)
    values = [_resolve(*rewrite.imports[alias]) for alias in aliases]
    function = vars(namespace[_FACTORY](*values))[rewrite.method_name]
    _point_class_cell(function, klass)
    return function


def _point_class_cell(function: Callable, klass: type) -> None:
    """Zero-argument super() reads the ``__class__`` cell: make it the real class, not the shell."""
    fn = function
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and "__class__" in code.co_freevars:
            fn.__closure__[code.co_freevars.index("__class__")].cell_contents = klass
        fn = getattr(fn, "__wrapped__", None)


def _identifiers(node: cst.CSTNode) -> set[str]:
    return {n.value for n in m.findall(node, m.Name())}


def _precheck(source: MethodSource) -> None:
    """Refusals that apply to any edit of this method."""
    fn = source.function
    free = [v for v in fn.__code__.co_freevars if v != "__class__"]
    if free:
        raise NoMatch(
            "source.closure",
            f"{fn.__qualname__} is a closure over {', '.join(free)}; its source cannot be recompiled on its own.",
        )
    mangled = sorted(
        n for n in _identifiers(source.node) if n.startswith("__") and not n.endswith("__")
    )
    if mangled:
        raise NoMatch(
            "source.name-mangled",
            f"{fn.__qualname__} uses the name-mangled {mangled[0]}, which means another name outside its class.",
        )
    if source.node.asynchronous is not None:
        raise NoMatch("source.async", f"{fn.__qualname__} is a coroutine.")


def rewrite_method(
    cls: type, function: Callable, edits: list[tuple[str, Edit]]
) -> tuple[MethodRewrite | None, dict[str, NoMatch]]:
    """Apply ``edits`` (kind, edit) in order to ``function``'s source; an edit that refuses is left out.

    Returns the rewrite of the edits that succeeded (None if none did) and the refusals by kind.
    """
    refusals: dict[str, NoMatch] = {}
    source = method_source(function)
    if source is None:
        refusal = NoMatch("source.unavailable", f"the source of {cls.__name__}.{function.__name__} is not available.")
        return None, {kind: refusal for kind, _ in edits}
    try:
        _precheck(source)
    except NoMatch as refusal:
        return None, {kind: refusal for kind, _ in edits}
    context = EditContext(cls, source, _identifiers(source.node))
    tree, applied = source.node, []
    for kind, edit in edits:
        saved = (set(context.names), dict(context.imports), list(context.notes))
        try:
            tree = edit(tree, context)
            applied.append(kind)
        except NoMatch as refusal:
            refusals[kind] = refusal
            context.names, context.imports, context.notes = saved
    if not applied:
        return None, refusals
    rewrite = MethodRewrite(cls, source, tree, context.imports, tuple(applied), notes=tuple(context.notes))
    try:
        rewrite.forward_for(cls)
    except NoMatch as refusal:
        return None, {**refusals, **{kind: refusal for kind in applied}}
    return rewrite, refusals
