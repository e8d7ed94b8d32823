"""The rules of ``transfuse.ops.graphs.SmallBatchGraphs`` on CPU, with the CUDA capture replaced by a
stand-in that replays the forward into the captured output buffer: when a shape is captured, which
changes mean a new capture, and which calls never replay. (The real capture runs in
tests/test_decode_graphs.py on a GPU.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transfuse.ops import dispatch, graphs


class _Replay:
    def __init__(self, forward, static_x, static_out):
        self.forward, self.static_x, self.static_out = forward, static_x, static_out

    def replay(self):
        self.static_out.copy_(self.forward(self.static_x))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.proj(x) * 2


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(graphs, "_raw_stream", lambda device: 7)
    layer = _Layer()
    table = graphs.SmallBatchGraphs(layer, layer.forward, max_tokens=4)
    captures = []

    def record(self, x, key):  # stands in for the CUDA capture
        captures.append(key)
        static_x = x.clone()
        static_out = self.forward(static_x)
        return _Replay(self.forward, static_x, static_out), static_x, static_out

    monkeypatch.setattr(graphs.SmallBatchGraphs, "_record", record)
    table.captures = captures
    table.owner = layer  # the table itself holds no reference to its layer
    return table


def test_a_shape_is_captured_when_seen_twice_and_replays_fresh_outputs(table):
    layer = table.owner
    with torch.no_grad():
        x1, x2, x3 = (torch.randn(1, 2, 8) for _ in range(3))
        assert torch.equal(table(x1), layer(x1)) and table.captures == []
        out2 = table(x2)
        out3 = table(x3)
        assert len(table.captures) == 1
        assert torch.equal(out2, layer(x2)) and torch.equal(out3, layer(x3))  # out2 was not overwritten
        table(torch.randn(1, 3, 8))  # another shape: seen once
        assert len(table.captures) == 1 and len(table._graphs) == 1


def test_replaced_weights_and_a_new_dispatch_generation_mean_a_new_capture(table, monkeypatch):
    layer = table.owner
    x = torch.randn(2, 8)
    with torch.no_grad():
        table(x), table(x)
        layer.proj.weight = nn.Parameter(torch.randn(8, 8))  # a new tensor under the same name
        assert torch.equal(table(x), layer(x)) and len(table.captures) == 1  # seen once: eager
        assert torch.equal(table(x), layer(x)) and len(table.captures) == 2
        assert len(table._graphs) == 1  # the old weights' graph is dropped
        layer.proj.weight.mul_(3)  # in place: the same graph reads it
        assert torch.equal(table(x), layer(x)) and len(table.captures) == 2
        monkeypatch.setattr(dispatch, "_GENERATION", dispatch.generation() + 1)
        table(x), table(x)
        assert len(table.captures) == 3 and len(table._graphs) == 1


def test_calls_that_must_run_the_code_never_replay(monkeypatch):
    layer = _Layer()
    table = graphs.SmallBatchGraphs(layer, layer.forward, max_tokens=4)
    cpu = torch.randn(1, 8)
    assert not table.graphable(cpu)  # not on a GPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)  # a CPU tensor's get_device()
    with torch.no_grad():
        assert table.graphable(cpu)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        assert not table.graphable(cpu)  # not on the current device
        monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
        assert not table.graphable(torch.randn(5, 8))  # more tokens than max_tokens
        handle = layer.proj.register_forward_hook(lambda *args: None)
        assert not table.graphable(cpu)  # a hook on a child would run only at capture
        handle.remove()
        handle = layer.register_forward_hook(lambda *args: None)
        assert table.graphable(cpu)  # the layer's own hooks run around every call anyway
        handle.remove()
        with graphs.suspended():
            assert not table.graphable(cpu)
        assert table.graphable(cpu)
        monkeypatch.setenv("TRANSFUSE_DECODE_GRAPHS", "0")
        assert not table.graphable(cpu)
    assert not table.graphable(cpu.requires_grad_())  # autograd has to record
    monkeypatch.delenv("TRANSFUSE_DECODE_GRAPHS")
    assert not table.graphable(torch.randn(1, 8))  # the layer's parameters require grad
    with torch.no_grad():
        assert table.graphable(torch.randn(1, 8))


def test_keys_seen_once_are_bounded(table):
    kept = []  # every weight stays alive, so each has its own address
    with torch.no_grad():
        for _ in range(graphs._MAX_SEEN + 10):
            kept.append(nn.Parameter(torch.randn(8, 8)))
            table.owner.proj.weight = kept[-1]
            table(torch.randn(1, 8))
    assert len(table._seen) == graphs._MAX_SEEN and table.captures == []


def test_a_shape_that_fails_to_capture_runs_eagerly_with_one_warning(monkeypatch):
    monkeypatch.setattr(graphs, "_raw_stream", lambda device: 7)
    attempts = []

    def record(self, x, key):
        attempts.append(key)
        raise RuntimeError("called a synchronizing CUDA operation")

    monkeypatch.setattr(graphs.SmallBatchGraphs, "_record", record)
    layer = _Layer()
    table = graphs.SmallBatchGraphs(layer, layer.forward, max_tokens=4)
    x = torch.randn(1, 8)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="runs eagerly at \\(1, 8\\).*synchronizing") as caught:
            outs = [table(x) for _ in range(4)]
    assert len(caught) == 1 and len(attempts) == 1 and table._graphs == {}
    assert all(torch.equal(out, layer(x)) for out in outs)
    assert table.failed.startswith("RuntimeError")


def test_a_table_does_not_keep_its_layer_alive():
    """The tables live in a dictionary weakly keyed by their layer: a table holding the layer would
    keep every layer (and its weights) alive for good."""
    import gc
    import weakref

    layer = _Layer()
    alive = weakref.ref(layer)
    table = graphs.SmallBatchGraphs(layer, lambda x: x, max_tokens=4)
    del layer
    gc.collect()
    assert alive() is None and table.name == "_Layer"


def test_a_graph_s_copy_of_an_input_keeps_its_strides_where_it_can():
    """Compiled code may assume an input's strides (``generate`` passes a column of its ids):
    the graph's own copy has them, or, for an input whose elements share memory (expanded),
    is a dense copy; the values are the input's either way."""
    column = torch.arange(33).reshape(3, 11)[:, -1:]
    copied = graphs.input_buffer(column)
    assert copied.stride() == (11, 1) and torch.equal(copied, column)
    assert copied.data_ptr() != column.data_ptr()
    expanded = torch.arange(4).unsqueeze(0).expand(3, -1)
    copied = graphs.input_buffer(expanded)
    assert copied.is_contiguous() and torch.equal(copied, expanded)


@torch.library.custom_op("transfuse::_test_reads_inside", mutates_args=())
def _reads_inside(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.sum())  # (``float(t)`` reads the value on the host)


def test_the_warm_up_makes_reads_of_device_values_on_the_host_errors_in_its_own_thread_only():
    """What a capture cannot hold fails the warm-up (``_NoHostReads``, the CPU standing in for the
    GPU here): ``.item()``, ``bool(t)``, ``nonzero``, indexing by a mask, a copy to the host, and
    such a read inside one of transfuse's library ops; other ops run. Another thread's reads
    meanwhile are its own business."""
    import threading

    x = torch.randn(6)
    reads = {
        "item": lambda: x.sum().item(),
        "bool": lambda: bool(x.sum() > 0),
        "nonzero": lambda: torch.nonzero(x),
        "a mask": lambda: x[x > 0],
        "a masked write": lambda: x.clone().index_put_((x > 0,), torch.tensor(0.0)),
        "inside a library op": lambda: _reads_inside(x),
    }
    for name, read in reads.items():
        with pytest.raises(graphs.HostRead), graphs._NoHostReads("cpu"):
            read()
    with graphs._NoHostReads("cpu"):
        made = (torch.cat([x, x]) * 2 + 1).softmax(-1).argmax()
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(x.sum().item()))
        thread.start()
        thread.join()
    assert elsewhere == [x.sum().item()] and int(made) == int(x.argmax())
