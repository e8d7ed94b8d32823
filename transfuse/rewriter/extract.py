"""Module-level definitions of transfuse's modules, extracted as source with all they use (libcst).

``extract(roots)`` starts from ``(module, name)`` pairs and follows every name their code reads (not
annotations: the result is written under ``from __future__ import annotations``) to its module-level
definition, through transfuse's own imports, function-local ones included. What it finds:

* a definition, as its source (comments directly above it kept); a function with a form in
  ``transfuse.rewriter.standalone`` (``replaces``) is that form instead, without the decorator;
* an op's declaration ``NAME = Op("name", native, ...)``: ``NAME = native``, the op's native
  definition (no dispatch without transfuse);
* a name imported from outside transfuse (torch, the standard library): that import.

Where the code reaches what cannot run without transfuse (the dispatch, its settings, a
``torch.library`` op of its own), extraction fails naming the path that led there: such a function
needs a form. Definitions come out in an order that runs (what a definition reads when it is
executed comes before it: bases, decorators, defaults, values), otherwise in their source order.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import GlobalScope, ImportAssignment, ParentNodeProvider, PositionProvider, ScopeProvider

from .standalone import FORMS

__all__ = ["ExtractError", "Extracted", "extract"]

# Modules that only make sense with transfuse: reaching them means a form is missing.
_FORBIDDEN = ("transfuse.ops.dispatch", "transfuse.ops.conformance", "transfuse.ops.platform", "transfuse.settings")
_OP = ("transfuse.ops.dispatch", "Op")
_IMPLICIT = {"__name__", "__file__", "__doc__"}


class ExtractError(Exception):
    """A definition cannot be extracted to run without transfuse; the message says which and why."""


@dataclass
class Definition:
    module: str
    names: set[str]  # the names the statement binds
    code: str
    load_refs: set[str]  # names read when the statement runs (not inside function bodies)
    line: int
    form: bool = False  # a form from transfuse.rewriter.standalone, in place of the module's own


@dataclass
class Extracted:
    definitions: list[Definition]  # in an order that runs
    # alias -> (module, name imported from it; None: the module itself), from outside transfuse
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)


class _Module:
    """One module's syntax tree with what extraction asks of it: which statement defines a name,
    what its imports bind, and where each name read resolves."""

    def __init__(self, name: str):
        self.name = name
        module = importlib.import_module(name)
        wrapper = cst.MetadataWrapper(cst.parse_module(inspect.getsource(module)))
        self.tree = wrapper.module
        self.package = module.__package__
        scopes = wrapper.resolve(ScopeProvider)
        self.parents = wrapper.resolve(ParentNodeProvider)
        self.positions = wrapper.resolve(PositionProvider)
        self.accesses = {}
        for scope in {s for s in scopes.values() if s is not None}:
            for access in scope.accesses:
                self.accesses[id(access.node)] = access
        self.definitions: dict[str, cst.CSTNode] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}  # alias -> (module, name or None: the module)
        for statement in self.tree.body:
            self._index(statement)

    def _index(self, statement: cst.CSTNode) -> None:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            self.definitions[statement.name.value] = statement
        elif isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    self.imports.update(self.bound_by(small))
                for target in _assigned(small):
                    self.definitions.setdefault(target, statement)

    def absolute(self, node: cst.ImportFrom) -> str:
        if not node.relative:
            return _dotted(node.module)
        base = self.package.rsplit(".", len(node.relative) - 1)[0] if len(node.relative) > 1 else self.package
        return f"{base}.{_dotted(node.module)}" if node.module is not None else base

    def bound_by(self, node: cst.Import | cst.ImportFrom) -> dict[str, tuple[str, str | None]]:
        bound = {}
        for alias in node.names:
            name = _dotted(alias.name)
            local = alias.asname.name.value if alias.asname else name.split(".")[0]
            if isinstance(node, cst.Import):
                bound[local] = (name if alias.asname else name.split(".")[0], None)
            else:
                bound[local] = (self.absolute(node), name)
        return bound


def _dotted(node: cst.BaseExpression) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _assigned(small: cst.BaseSmallStatement) -> list[str]:
    if isinstance(small, cst.Assign):
        targets = [t.target for t in small.targets]
    elif isinstance(small, cst.AnnAssign) and small.value is not None:
        targets = [small.target]
    else:
        return []
    names = []
    for target in targets:
        elements = [e.value for e in target.elements] if isinstance(target, cst.Tuple) else [target]
        names += [e.value for e in elements if isinstance(e, cst.Name)]
    return names


@functools.cache
def _module(name: str) -> _Module:
    return _Module(name)


def _is_transfuse(module: str) -> bool:
    return module == "transfuse" or module.startswith("transfuse.")


def _in_function(scope) -> bool:
    while scope is not None and not isinstance(scope, GlobalScope):
        if type(scope).__name__ == "FunctionScope":
            return True
        scope = scope.parent
    return False


def _names(node: cst.CSTNode) -> list[cst.Name]:
    found: list[cst.Name] = []

    class Collect(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.append(name)

    node.visit(Collect())
    return found


class _Extraction:
    def __init__(self):
        self.done: dict[tuple[str, str], Definition] = {}
        self.statements: dict[tuple[str, int], Definition] = {}  # (module, id of the statement) -> its definition
        self.by_name: dict[str, tuple[str, str]] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}
        self.visiting: set[tuple[str, str]] = set()
        self.order: list[str] = []  # modules in the order first reached

    def add(self, module: str, name: str, path: tuple[str, ...]) -> str:
        """Extract ``module.name`` (reached through ``path``); the name it has in the result."""
        module, name = self._origin(module, name, path)
        key = (module, name)
        if key in self.done or key in self.visiting:
            return name
        here = (*path, f"{module}.{name}")
        if any(module == f or module.startswith(f + ".") for f in _FORBIDDEN):
            raise ExtractError(
                f"{' -> '.join(here)}: {module} needs transfuse; give the first function of this path that needs "
                "it a form in transfuse/rewriter/standalone.py."
            )
        other = self.by_name.setdefault(name, key)
        if other != key:
            raise ExtractError(f"{module}.{name} and {other[0]}.{other[1]} would have one name in the runtime; rename one.")
        if module not in self.order:
            self.order.append(module)
        statement = _module(module).definitions[name]
        known = self.statements.get((module, id(statement)))
        if known is not None:  # another name of a statement that binds several
            self.done[key] = known
            return name
        form = FORMS.get(key)
        source = _module(form.__module__) if form is not None else _module(module)
        self.visiting.add(key)
        definition = self._definition(source, source.definitions[name] if form is not None else statement, here)
        self.visiting.discard(key)
        if form is not None:  # placed where the original is
            definition.module, definition.line, definition.form = module, _module(module).positions[statement].start.line, True
        self.done[key] = self.statements[(module, id(statement))] = definition
        return name

    def _origin(self, module: str, name: str, path) -> tuple[str, str]:
        """Where ``module.name`` is defined, following the imports that re-export it."""
        source = _module(module)
        while name not in source.definitions:
            if name not in source.imports:
                raise ExtractError(f"{' -> '.join(path)}: {module} has no {name} at its top level.")
            module, imported = source.imports[name]
            if imported is None or not _is_transfuse(module):
                raise ExtractError(f"{' -> '.join(path)}: {source.name} only imports {name} from {module}.")
            source, name = _module(module), imported
        return source.name, name

    def _definition(self, source: _Module, statement: cst.CSTNode, path) -> Definition:
        line = source.positions[statement].start.line
        bound = _bound(statement)
        op = _op_declaration(source, statement)
        if op is not None:
            target, native = op
            ref = self._follow(source, native, path)
            (name,) = bound
            return Definition(source.name, bound, f"# the op {target!r}: its native definition\n{name} = {ref}", {ref}, line)
        if isinstance(statement, cst.FunctionDef) and statement.decorators:
            statement = statement.with_changes(decorators=[d for d in statement.decorators if not _is_form_marker(d)])
        load_refs, local_imports = set(), False
        for node in _names(statement):
            reference = self._reference(source, node)
            if reference is None:
                continue
            if reference == "local import":
                local_imports = True
            elif _attribute_of_op(source, node):
                raise ExtractError(f"{' -> '.join(path)}: reads {node.value}'s attributes as a dispatched op; give it a form.")
            ref = self._follow(source, node.value, path)
            if not _in_function(source.accesses[id(node)].scope):
                load_refs.add(ref)
        _check_runs_without_transfuse(statement, path)
        code = _without_local_imports(source, statement) if local_imports else _code(source, statement)
        return Definition(source.name, bound, code, load_refs, line)

    def _reference(self, source: _Module, node: cst.Name):
        """None (not a module-level name), "local import" (a function's own import from transfuse),
        or "global"."""
        access = source.accesses.get(id(node))
        if access is None or access.is_annotation or access.is_type_hint:
            return None
        if not access.referents:
            if hasattr(builtins, node.value) or node.value in _IMPLICIT:
                return None
            raise ExtractError(f"{source.name}: {node.value} is not defined.")
        for referent in access.referents:
            if isinstance(referent.scope, GlobalScope):
                return "global"
            if (
                isinstance(referent, ImportAssignment)
                and isinstance(referent.node, cst.ImportFrom)
                and _is_transfuse(source.absolute(referent.node))
            ):
                return "local import"  # a function's ``import transfuse`` (the runtime's last step) stays
        return None

    def _follow(self, source: _Module, name: str, path) -> str:
        """The runtime's name for what ``name`` refers to in ``source`` (extracted or imported)."""
        if name in source.definitions:
            return self.add(source.name, name, path)
        module, imported = source.imports.get(name) or _local_import(source, name)
        if _is_transfuse(module):
            if imported is None:
                raise ExtractError(f"{' -> '.join(path)}: uses the module {module} as a whole.")
            return self.add(module, imported, path)
        if self.imports.setdefault(name, (module, imported)) != (module, imported):
            raise ExtractError(f"{name} is imported from {self.imports[name]} and from {(module, imported)}.")
        return name

    def ordered(self) -> list[Definition]:
        """Definitions in an order that runs: each after what it reads when it runs, else by module
        (in the order reached) and line."""
        rank = {module: i for i, module in enumerate(self.order)}
        pending = sorted({id(d): d for d in self.done.values()}.values(), key=lambda d: (rank[d.module], d.line))
        placed: list[Definition] = []
        names = set(self.imports)
        while pending:
            ready = next((d for d in pending if d.load_refs <= names | d.names), None)
            if ready is None:
                raise ExtractError(f"The definitions of {[sorted(d.names) for d in pending]} read each other when they run.")
            pending.remove(ready)
            placed.append(ready)
            names |= ready.names
        return placed


def _bound(statement: cst.CSTNode) -> set[str]:
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return {statement.name.value}
    return {name for small in statement.body for name in _assigned(small)}


def _local_import(source: _Module, name: str) -> tuple[str, str | None]:
    """What a function-local import in ``source`` binds to ``name``."""
    for access in source.accesses.values():
        for referent in access.referents:
            if isinstance(referent, ImportAssignment) and referent.name == name:
                return source.bound_by(referent.node)[name]
    raise ExtractError(f"{source.name}: {name} is neither defined nor imported.")


def _code(source: _Module, statement: cst.CSTNode) -> str:
    """The statement's source, with the comment lines directly above it (not those before a blank line)."""
    lines = list(getattr(statement, "leading_lines", ()))
    kept = len(lines)
    while kept and lines[kept - 1].comment is not None:
        kept -= 1
    if hasattr(statement, "leading_lines"):
        statement = statement.with_changes(leading_lines=lines[kept:])
    return source.tree.code_for_node(statement).strip("\n")


def _op_declaration(source: _Module, statement: cst.CSTNode) -> tuple[str, str] | None:
    """``(op name, native function's name)`` for ``NAME = Op("name", native, ...)``."""
    if not m.matches(statement, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], value=m.Call(func=m.Name()))])):
        return None
    call = statement.body[0].value
    if source.imports.get(call.func.value) != _OP:
        return None
    positional = [a.value for a in call.args if a.keyword is None]
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    name = positional[0] if positional else keywords.get("name")
    native = positional[1] if len(positional) > 1 else keywords.get("native")
    if not isinstance(native, cst.Name) or not isinstance(name, cst.SimpleString):
        raise ExtractError(f"{source.name}: an Op is declared with a native definition that is not a name.")
    return name.evaluated_value, native.value


def _is_form_marker(decorator: cst.Decorator) -> bool:
    return m.matches(decorator.decorator, m.Call(func=m.Name("replaces")))


def _attribute_of_op(source: _Module, node: cst.Name) -> bool:
    statement = source.definitions.get(node.value)
    parent = source.parents.get(node)
    return (
        statement is not None
        and isinstance(parent, cst.Attribute)
        and parent.value is node
        and _op_declaration(source, statement) is not None
    )


def _without_local_imports(source: _Module, statement: cst.CSTNode) -> str:
    """The statement's source without its function-local imports from transfuse (their names are
    the runtime's own)."""

    class Strip(cst.CSTTransformer):
        def leave_SimpleStatementLine(self, original, updated):
            imports = [s for s in original.body if isinstance(s, cst.ImportFrom)]
            if imports and len(imports) == len(original.body) and all(_is_transfuse(source.absolute(s)) for s in imports):
                return cst.RemoveFromParent()
            return updated

    return cst.parse_module(_code(source, statement)).visit(Strip()).code.strip("\n")


def _check_runs_without_transfuse(statement: cst.CSTNode, path) -> None:
    """No use of transfuse's library ops (``torch.ops.transfuse``) or registration of one (``torch.library``)."""
    found: list[str] = []

    class Find(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            dotted = _dotted(node)
            if dotted.startswith(("torch.ops.transfuse", "torch.library")):
                found.append(dotted)

    statement.visit(Find())
    if found:
        raise ExtractError(f"{' -> '.join(path)}: uses {found[0]}, which needs transfuse; give it a form.")


def extract(roots) -> Extracted:
    """The definitions of ``roots`` (``(module, name)`` pairs) and all they use; see the module docstring."""
    extraction = _Extraction()
    for module, name in sorted(roots):
        extraction.add(module, name, ())
    return Extracted(extraction.ordered(), dict(sorted(extraction.imports.items())))
