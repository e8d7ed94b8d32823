"""The ``"transfuse"`` backend of ``torch.compile``: the graph split at attention, Inductor per
piece, and on CUDA a graph per piece and shape.

Dynamo hands the backend one FX graph per compiled frame. The backend cuts it before and
after every ``transfuse::cached_attention`` node (``split_module``), so the pieces between
two attention layers hold everything else: norms, the merged projections, RoPE, the MLP or
MoE block, the residual adds. Each piece is compiled by Inductor with the fake inputs Dynamo
traced it with (symbolic sizes stay symbolic); the attention nodes run as they are, eagerly,
between the pieces.

On CUDA a piece whose inputs all have static shapes (Dynamo specialises a decode step's
token count of 1, so a decode step's pieces are static) is run through ``GraphedPiece``:
captured as a CUDA graph the second time it runs at a shape and replayed afterwards. The
graphs of one device share one memory pool, captured and replayed in order on one stream.
A piece's weights are read by address: inputs that are the model's parameters or buffers
are part of the graph's key, every other input is copied into the graph's own buffer.

A graph that does not include the attention op (``torch.compile(model, backend="transfuse")``
on a model ``transfuse.compile`` did not prepare) is one piece: Inductor, and a CUDA graph
only where its shapes are static.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn

from ..ops.graphs import capture, copy_out, graph_pool, input_buffer
from .attention import current_step, current_store

__all__ = ["ATTENTION_OP", "GraphedPiece", "Layout", "StepGraph", "assemble", "compile_graph", "stats"]

ATTENTION_OP = "transfuse.cached_attention"

# Counters a test or a benchmark reads: graphs compiled by the backend, pieces, captures and
# replays (of pieces and of whole steps), and those of whole steps alone.
_STATS = {"graphs": 0, "pieces": 0, "captures": 0, "replays": 0, "step_captures": 0, "step_replays": 0}
# Addresses of captured graphs' outputs: they hold the same place at every replay, so a later
# piece reads them where they are (checked at every replay) instead of copying them in.
_GRAPH_OUTPUTS: set[int] = set()
# Depth of ``StepGraph`` calls in progress in this thread (``in_step``): their pieces run inside
# the step's own graph (or its warm-up) and capture nothing of their own.
_THREAD = threading.local()


def stats() -> dict[str, int]:
    return dict(_STATS)


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and ATTENTION_OP in str(node.target)


def _static(value: Any) -> bool:
    if isinstance(value, torch.SymInt):
        return False
    if isinstance(value, Tensor):
        return all(isinstance(s, int) for s in value.shape)
    return True


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    inductor: bool = True,
    cuda_graphs: bool = True,
    static_pointers: Callable[[], set[int]] | None = None,
    on_frame: Callable[[], None] | None = None,
    kept: list["Layout"] | None = None,
) -> Callable[..., Any]:
    """Compile one Dynamo graph: split at attention, each piece compiled, graphed where static.
    ``on_frame`` is called first, while Dynamo's records of the frame are current
    (``replay.DynamoEntries.record``); ``kept`` receives the graph's ``Layout``."""
    from torch.fx.passes.split_module import split_module

    _STATS["graphs"] += 1
    if on_frame is not None:
        on_frame()
    fakes = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
    if any(f is None for f in fakes):  # not from Dynamo (a test's own graph): use what it was given
        fakes = list(example_inputs)

    partition = 0
    owner: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_attention(node):
            partition += 1
            owner[node] = partition
            partition += 1
        else:
            owner[node] = partition
    split = split_module(gm, None, lambda node: owner[node], keep_original_order=True)

    # Pieces whose results are (or are items of) the graph's own outputs.
    reaching_output: set[str] = set()
    for node in split.graph.nodes:
        if node.op == "output":
            for source in node.all_input_nodes:
                while source.op == "call_function" and source.all_input_nodes and "getitem" in str(source.target):
                    source = source.all_input_nodes[0]
                if source.op == "call_module":
                    reaching_output.add(source.target)

    # The fake inputs each piece is called with, by running the split graph on fakes.
    piece_inputs: dict[str, list[Any]] = {}
    _record_piece_inputs(split, fakes, piece_inputs)

    layout: dict[str, tuple[str, bool]] = {}
    compiled_pieces: dict[str, Callable[..., Any]] = {}
    single: dict[str, bool] = {}
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        piece = getattr(split, node.target)
        if any(_is_attention(inner) for inner in piece.graph.nodes):
            layout[node.target] = ("attention", False)
            continue
        inputs = piece_inputs[node.target]
        compiled: Callable[..., Any] = piece
        if inductor:
            from torch._inductor.compile_fx import compile_fx, graph_returns_tuple

            single[node.target] = not graph_returns_tuple(piece)  # (before Inductor makes it return a tuple)
            with torch._inductor.config.patch(_inductor_settings()):
                compiled = compile_fx(piece, inputs)
        compiled_pieces[node.target] = compiled
        graphed = cuda_graphs and all(_static(v) for v in inputs) and _on_cuda(inputs)
        layout[node.target] = ("graphed" if graphed else "compiled", node.target in reaching_output)
    step_graph = cuda_graphs and partition > 0 and _on_cuda(fakes)
    if kept is not None:
        kept.append(Layout(_bare_copy(split, layout), layout, step_graph, compiled_pieces, single))
    return assemble(split, layout, compiled_pieces, step_graph, static_pointers)


def _inductor_settings() -> dict[str, Any]:
    """Inductor's settings for a piece compiled inside a batch-invariant model's forward (none
    otherwise): what Inductor generates itself (elementwise code, and any reduction the mode
    leaves to it) then computes a row the same way at every batch size. Intermediate values are
    rounded to their dtype as eager code rounds them (``emulate_precision_casts``), so whether a
    chain of elementwise ops is fused, which Inductor decides per shape, does not change a bit,
    and the compiled path rounds as the eager path does; reductions are not split across
    programs by the row count (``split_reductions``); and where the installed torch has it,
    Inductor's own ``batch_invariant`` setting fixes the launch configuration of its reductions."""
    from ..ops import dispatch

    if not dispatch._INVARIANT_CALLS:
        return {}
    import torch._inductor.config as config

    wanted = {"emulate_precision_casts": True, "split_reductions": False, "batch_invariant": True}
    return {name: value for name, value in wanted.items() if hasattr(config, name)}


class Layout:
    """How ``compile_graph`` assembled a split graph, for a caller that keeps it
    (``transfuse/compile/precompiled.py``): the split graph as split (``_bare_copy``), each piece's kind ("attention",
    "compiled", or "graphed": a compiled piece replayed as a CUDA graph per shape) and whether its
    results leave the graph, whether the whole step is a ``StepGraph``, the compiled pieces as
    Inductor returned them, and which of them return a single value (Inductor's own code returns
    a sequence, which ``compile_fx`` unpacks for a graph that returns one value)."""

    def __init__(
        self,
        split: fx.GraphModule,
        pieces: dict[str, tuple[str, bool]],
        step_graph: bool,
        compiled: dict[str, Callable[..., Any]] | None = None,
        single: dict[str, bool] | None = None,
    ):
        self.split = split
        self.pieces = pieces
        self.step_graph = step_graph
        self.compiled = compiled or {}
        self.single = single or {}


def _bare_copy(split: fx.GraphModule, layout: dict[str, tuple[str, bool]]) -> fx.GraphModule:
    """The split graph as split, with its attention pieces and an empty module for each other
    piece, no node carrying Dynamo's metadata (fake tensors, stack traces)."""
    root: dict[str, Any] = {}
    for name, (kind, _) in layout.items():
        root[name] = fx.GraphModule(split._modules[name], _bare(split._modules[name].graph)) if kind == "attention" else nn.Module()
    return fx.GraphModule(root, _bare(split.graph))


def _bare(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    copied.output(copied.graph_copy(graph, {}))
    for node in copied.nodes:
        node.meta = {}
    return copied


def assemble(
    split: fx.GraphModule,
    layout: dict[str, tuple[str, bool]],
    compiled: dict[str, Callable[..., Any]],
    step_graph: bool,
    static_pointers: Callable[[], set[int]] | None,
) -> Callable[..., Any]:
    """The runnable split graph: each attention piece calling the op's body, each compiled piece
    ``compiled[name]`` (in a ``GraphedPiece`` where ``layout`` says so), the whole a ``StepGraph``
    where ``step_graph``."""
    for name, (kind, leaves) in layout.items():
        if kind == "attention":
            _call_attention_directly(getattr(split, name))
            continue
        _STATS["pieces"] += 1
        runner: Callable[..., Any] = compiled[name]
        if kind == "graphed":
            runner = GraphedPiece(runner, name, static_pointers, copy_outputs=leaves)
        # A plain callable, not a module: the split module calls ``self.<piece>(...)`` and a
        # module's ``__call__`` would add its hook checks to every piece of every token.
        if name in split._modules:
            delattr(split, name)
        object.__setattr__(split, name, runner)
    split.recompile()
    if step_graph:
        return StepGraph(split, static_pointers)
    return split


def _call_attention_directly(piece: fx.GraphModule) -> None:
    """The attention piece calls the op's Python body, not the op (same arguments, same
    result; none of the dispatcher's cost on a path that runs every layer of every token)."""
    from .attention import cached_attention

    for node in piece.graph.nodes:
        if _is_attention(node):
            node.target = cached_attention
    piece.recompile()


def _on_cuda(inputs: Sequence[Any]) -> bool:
    return any(isinstance(v, Tensor) and v.device.type == "cuda" for v in inputs)


def _record_piece_inputs(split: fx.GraphModule, fakes: Sequence[Any], into: dict[str, list[Any]]) -> None:
    """Run the split graph on the fake inputs and note the arguments each piece gets."""
    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):  # noqa: ANN001
            into[target] = list(args)
            return super().call_module(target, args, kwargs)

    mode = next((f.fake_mode for f in fakes if hasattr(f, "fake_mode")), None)
    if mode is None:
        Recorder(split).run(*fakes)
        return
    with mode:
        Recorder(split).run(*fakes)


class _PerShape:
    """The bookkeeping of graphs captured per input shape, which ``GraphedPiece`` and
    ``StepGraph`` share: the shapes seen once (captured the second time), those whose capture
    failed (run without a graph from then on), the graphs."""

    def __init__(self, static_pointers: Callable[[], set[int]] | None):
        self.static_pointers = static_pointers or (lambda: set())
        # The first capture failure, as one line (later ones are not reported again).
        self.failed: str | None = None
        self._seen: set[tuple] = set()
        self._failed: set[tuple] = set()
        self._graphs: dict[tuple, _Graph] = {}
        # Positions of the arguments that are not the model's tensors, found at the first call:
        # the graph key holds their shapes (the model's tensors are checked by address).
        self._moving: tuple[int, ...] | None = None

    def _shapes(self, args: Sequence[Any]) -> tuple:
        if self._moving is None:
            static = self.static_pointers()
            self._moving = tuple(
                i for i, a in enumerate(args) if not (isinstance(a, Tensor) and a.data_ptr() in static)
            )
        return tuple(args[i].shape if isinstance(args[i], Tensor) else args[i] for i in self._moving)

    def _capture_failed(self, key: tuple, exc: Exception, consequence: str) -> None:
        self._failed.add(key)
        if self.failed is None:
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"transfuse.compile: {consequence}: capturing failed ({self.failed})", stacklevel=3)


class GraphedPiece(_PerShape):
    """A compiled piece replayed as a CUDA graph per input shape (the second time it runs at a
    shape; the first run is its warm-up). Falls back to running the piece where a graph
    cannot be used: autograd recording, inside another capture, a capture that failed."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        static_pointers: Callable[[], set[int]] | None,
        copy_outputs: bool,
    ):
        super().__init__(static_pointers)
        self.fn = fn
        self.name = name
        # Outputs that leave the compiled graph are copied out of the graph's buffers (the next
        # replay overwrites them); the others are read by the next op of the same call.
        self.copy_outputs = copy_outputs

    def __call__(self, *args: Any) -> Any:
        if getattr(_THREAD, "in_step", 0) or torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing():
            return self.fn(*args)
        key = self._shapes(args)
        graph = self._graphs.get(key)
        if graph is not None and graph.matches(args):
            _STATS["replays"] += 1
            return graph.replay(args, self.copy_outputs)
        if key in self._failed:
            return self.fn(*args)
        if key not in self._seen:
            self._seen.add(key)
            return self.fn(*args)
        try:
            graph = _Graph.capture(self.fn, args, self.static_pointers() | _GRAPH_OUTPUTS)
        except Exception as exc:  # noqa: BLE001 - any failure means: run this shape eagerly
            self._capture_failed(key, exc, f"piece {self.name} runs without a CUDA graph")
            return self.fn(*args)
        _STATS["captures"] += 1
        self._graphs[key] = graph
        return graph.replay(args, self.copy_outputs)


class StepGraph(_PerShape):
    """The whole split graph, attention included, replayed as one CUDA graph, for the calls
    whose attention reads a ``KVStore`` (decode steps: ``kv_store.py``); a graph per input shape
    and store capacity, captured the second time it is seen. Other calls run the split graph
    with its pieces graphed one by one."""

    def __init__(self, split: fx.GraphModule, static_pointers: Callable[[], set[int]] | None):
        super().__init__(static_pointers)
        self.split = split

    def __call__(self, *args: Any) -> Any:
        store = current_store()
        if store is None or torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing():
            return self.split(*args)
        key = (store.key(), *self._shapes(args))
        graph = self._graphs.get(key)
        if graph is not None and graph.matches(args):
            _STATS["replays"] += 1
            _STATS["step_replays"] += 1
            current_step().replayed = True
            return graph.replay(args, True)
        if key in self._failed:
            return self.split(*args)
        _THREAD.in_step = getattr(_THREAD, "in_step", 0) + 1
        try:
            if key not in self._seen:
                self._seen.add(key)
                return self.split(*args)
            try:
                graph = _Graph.capture(self.split, args, self.static_pointers() | _GRAPH_OUTPUTS)
            except Exception as exc:  # noqa: BLE001 - any failure means: run this shape piece by piece
                from .kv_store import StoreUnusable

                if isinstance(exc, StoreUnusable):
                    raise
                self._capture_failed(key, exc, "decode steps run piece by piece (a whole step)")
                return self.split(*args)
        finally:
            _THREAD.in_step -= 1
        _STATS["captures"] += 1
        _STATS["step_captures"] += 1
        from .kv_store import live

        # Graphs of stores that grew or were dropped are never replayed again.
        for dead in [k for k in self._graphs if not live(k[0])]:
            del self._graphs[dead]
        self._graphs[key] = graph
        return graph.replay(args, True)


class _Graph:
    """One capture: the graph, the buffers its copied inputs are read from, its outputs."""

    def __init__(self, graph: Any, copied: list[int], buffers: list[Tensor], pinned: list[tuple[int, int]], outputs: Any):
        self.graph = graph
        self.copied = copied
        self.buffers = buffers
        self.pinned = pinned
        self.outputs = outputs

    @classmethod
    def capture(cls, fn: Callable[..., Any], args: Sequence[Any], static: set[int]) -> "_Graph":
        copied, buffers, pinned, inputs = [], [], [], list(args)
        for index, arg in enumerate(args):
            if not isinstance(arg, Tensor):
                continue
            if arg.data_ptr() in static:
                pinned.append((index, arg.data_ptr()))
            else:
                buffer = input_buffer(arg)
                copied.append(index)
                buffers.append(buffer)
                inputs[index] = buffer
        device = next(a.device for a in args if isinstance(a, Tensor))
        current = torch.cuda.current_stream(device)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, graph_pool(device.index, current.cuda_stream)):
            outputs = fn(*inputs)
        flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        _GRAPH_OUTPUTS.update(o.data_ptr() for o in flat if isinstance(o, Tensor))
        return cls(graph, copied, buffers, pinned, outputs)

    def matches(self, args: Sequence[Any]) -> bool:
        return all(args[index].data_ptr() == pointer for index, pointer in self.pinned)

    def replay(self, args: Sequence[Any], copy_outputs: bool) -> Any:
        for index, buffer in zip(self.copied, self.buffers):
            buffer.copy_(args[index])
        self.graph.replay()
        return copy_out(self.outputs) if copy_outputs else self.outputs
