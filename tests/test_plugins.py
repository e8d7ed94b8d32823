"""Out-of-tree packages, found through entry points: a provider for an existing op, a replacement
layer, and platforms (one wins over the built-ins; two are an error naming both).

Each test installs a throwaway distribution (a ``*.dist-info`` with ``entry_points.txt`` beside
its module) in a temporary directory on ``sys.path``; the fixture puts the platform, the loaded
plugins, the providers and the layers back as they were, so other tests see the built-in state.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import transfuse
from transfuse import ops
from transfuse.ops import dispatch, layers
from transfuse.ops import triton as triton_support
from transfuse.tiny import tiny_model

ACCEL_MODULE = textwrap.dedent(
    """
    from transfuse.ops import Platform, RMSNorm, register_layer, register_provider, rms_norm_native

    CALLS = []


    def accel_rms_norm(x, *args):
        CALLS.append(tuple(x.shape))
        return rms_norm_native(x, *args)


    class AccelRMSNorm(RMSNorm):
        pass


    def register():
        register_provider("rms_norm", "accel", accel_rms_norm)
        register_layer("RMSNorm", AccelRMSNorm)


    def platform():
        return Platform("accel", "cpu", ("accel",))
    """
)

OTHER_MODULE = textwrap.dedent(
    """
    from transfuse.ops import Platform

    def platform():
        return Platform("otheraccel", "cpu")
    """
)


def _reset_detection() -> None:
    ops.current_platform.cache_clear()
    triton_support.available.cache_clear()
    dispatch._PLUGINS_LOADED = False
    ops.refresh()


@pytest.fixture
def install(tmp_path):
    """``install(dist, module, source, entry_points)`` puts a distribution on sys.path; undone afterwards."""
    added_paths, added_modules = [], []
    saved_layers = dict(layers._LAYERS)
    saved_providers = {name: dict(op._providers) for name, op in dispatch._OPS.items()}
    saved_outside = list(dispatch._FROM_OUTSIDE)

    def _install(dist: str, module: str, source: str, entry_points: str) -> None:
        root = tmp_path / dist
        info = root / f"{dist}-0.1.dist-info"
        info.mkdir(parents=True)
        (root / f"{module}.py").write_text(source)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
        sys.path.insert(0, str(root))
        added_paths.append(str(root))
        added_modules.append(module)
        importlib.invalidate_caches()
        _reset_detection()

    yield _install
    for path in added_paths:
        sys.path.remove(path)
    for module in added_modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()
    layers._LAYERS.clear()
    layers._LAYERS.update(saved_layers)
    for name, providers in saved_providers.items():
        dispatch._OPS[name]._providers = providers
    dispatch._FROM_OUTSIDE[:] = saved_outside
    _reset_detection()


ACCEL_PROVIDERS = """
    [transfuse.providers]
    accel = accel_plugin:register
"""


def test_a_plugin_adds_a_provider_to_an_existing_op_and_replaces_a_layer(install):
    install("accel-plugin", "accel_plugin", ACCEL_MODULE, ACCEL_PROVIDERS)
    plugin = importlib.import_module("accel_plugin")
    assert ops.current_platform().name == "cpu"  # a provider alone does not change the platform
    x, weight = torch.randn(3, 16), torch.randn(16)
    # Registered from outside, it runs ahead of the platform's own providers without being named,
    # once it passed its conformance check (which ran it on other shapes first).
    with ops.trace() as log:
        out = ops.rms_norm(x, weight, 1e-6)
    assert [entry.provider for entry in log] == ["accel"] and plugin.CALLS[-1] == (3, 16)
    assert {(1, 16), (7, 16)} <= set(plugin.CALLS)  # its conformance check's one row and cut rows
    assert torch.equal(out, ops.rms_norm_native(x, weight, 1e-6, *ops.RMSNormSpec().flags()))
    ops.set_priority(["torch"], op="rms_norm")  # a priority the user sets runs what it names
    try:
        with ops.trace() as log:
            ops.rms_norm(x, weight, 1e-6)
    finally:
        ops.set_priority(None, op="rms_norm")
    assert [entry.provider for entry in log] == ["torch"]

    assert ops.layer("RMSNorm") is plugin.AccelRMSNorm
    model = transfuse.rewrite(tiny_model("llama"), fusions=["rms_norm"])
    fused = [m for m in model.modules() if isinstance(m, ops.RMSNorm)]
    assert fused and all(type(m) is plugin.AccelRMSNorm for m in fused)


def test_one_out_of_tree_platform_wins_and_its_priority_applies(install):
    install(
        "accel-plugin",
        "accel_plugin",
        ACCEL_MODULE,
        ACCEL_PROVIDERS + "\n    [transfuse.platforms]\n    accel = accel_plugin:platform\n",
    )
    platform = ops.current_platform()
    assert (platform.name, platform.out_of_tree, platform.priority) == ("accel", True, ("accel",))
    with ops.trace() as log:
        ops.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6)
    assert log[-1].provider == "accel"


def test_two_out_of_tree_platforms_are_an_error_naming_both(install):
    install("accel-plugin", "accel_plugin", ACCEL_MODULE, "[transfuse.platforms]\naccel = accel_plugin:platform\n")
    install("other-plugin", "other_plugin", OTHER_MODULE, "[transfuse.platforms]\nother = other_plugin:platform\n")
    with pytest.raises(RuntimeError, match="More than one out-of-tree") as error:
        ops.current_platform()
    assert "'accel'" in str(error.value) and "'otheraccel'" in str(error.value)
