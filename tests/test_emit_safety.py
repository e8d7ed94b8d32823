"""emit never loses data: it refuses its own source as output and links into a directory it
replaces; it keeps the checkpoint's dtype; it re-checks the destination at the final move; it
leaves no temporary directory behind, and a crash at any point leaves the old emission or the new
one (the next emit restores a kept copy and says so); the emitted directory follows the umask.

Crashes are real: a forked child runs the directory mechanics and ends with ``os._exit`` at
each step in turn, so no handler of it runs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import transfuse
from tests.test_cli import run_here
from transfuse.rewriter import emit_dir
from transfuse.rewriter.emit import EmitError, emit
from transfuse.tiny import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "llama"
    tiny_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rewritten(checkpoint):
    return transfuse.from_pretrained(checkpoint)


def _leftovers(parent) -> list[str]:
    return sorted(name for name in os.listdir(parent) if name.startswith("."))


def test_emit_refuses_its_own_checkpoint_as_output(checkpoint, tmp_path):
    weights = (checkpoint / "model.safetensors").read_bytes()
    outputs = {"the checkpoint itself": checkpoint, "inside it": checkpoint / "sub", "containing it": checkpoint.parent}
    for relation, out in outputs.items():
        result = run_here("emit", str(checkpoint), "--out", str(out), "--force", "--link", "-q")
        assert result.returncode == 1, (relation, result.stdout)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
        assert str(checkpoint) in result.stderr and "loading" not in result.stderr, result.stderr  # before any work
        assert (checkpoint / "model.safetensors").read_bytes() == weights
    assert not (checkpoint / "sub").exists()


def test_emit_never_links_into_the_directory_it_replaces(rewritten, checkpoint, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    emit(rewritten, first, checkpoint_dir=str(checkpoint))  # a copy of the weights
    emit(rewritten, second, checkpoint_dir=str(first), link=True)  # links to the copy
    weights = (first / "model.safetensors").read_bytes()
    with pytest.raises(EmitError, match="--link"):
        emit(rewritten, first, checkpoint_dir=str(second), link=True, force=True)
    assert (first / "model.safetensors").read_bytes() == weights and not os.path.islink(first / "model.safetensors")
    assert (second / "model.safetensors").read_bytes() == weights
    assert _leftovers(tmp_path) == []


def test_emit_keeps_the_checkpoints_dtype_and_says_so(tmp_path):
    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path / "ck")
    result = run_here("emit", str(tmp_path / "ck"), "--out", str(tmp_path / "out"), "--fusions", "rms_norm", "-q")
    assert result.returncode == 0, result.stderr
    assert "bfloat16" in result.stdout and "float32" not in result.stdout, result.stdout
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:  # the MoE weights are written, not copied
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    dtypes = {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    assert dtypes == {"BF16"}, dtypes


@pytest.mark.parametrize("content", ["empty", "with a file"])
def test_a_directory_that_appears_before_the_final_move_is_left_alone(rewritten, tmp_path, monkeypatch, content):
    out = tmp_path / "out"
    config_class = type(rewritten.config)
    save = config_class.save_pretrained

    def save_then_appear(self, *args, **kwargs):  # the last thing written before the move
        save(self, *args, **kwargs)
        out.mkdir(exist_ok=True)
        if content != "empty":
            (out / "keep.txt").write_text("user data")

    monkeypatch.setattr(config_class, "save_pretrained", save_then_appear)
    with pytest.raises(EmitError, match="appeared"):
        emit(rewritten, out)
    assert sorted(os.listdir(out)) == ([] if content == "empty" else ["keep.txt"])
    assert _leftovers(tmp_path) == []


def _tree(path) -> dict[str, str]:
    return {name: (path / name).read_text() for name in sorted(os.listdir(path))}


# The steps of the final move that the tests make fail or crash: every rename, exchange and removal.
STEPS = (("os", "rename"), (emit_dir, "_renameat2"), (emit_dir, "_remove"))


def _failing_at(monkeypatch, k: int, fail) -> list[str]:
    """Make the k-th call (from 1) of any step call ``fail`` instead; the list returned gets the
    name of the step that failed."""
    calls, failed = [0], []
    for owner, name in STEPS:
        owner = os if owner == "os" else owner
        original = getattr(owner, name)
        if original is None:
            continue

        def step(*args, _original=original, _name=name, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                failed.append(_name)
                fail()
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, step)
    return failed


def _fill(version: str):
    def fill(staging: str) -> None:
        with open(os.path.join(staging, "version.txt"), "w") as f:
            f.write(version)

    return fill


@pytest.fixture(params=["atomic exchange", "two renames"])
def exchange(request, monkeypatch):
    if request.param == "two renames":
        monkeypatch.setattr(emit_dir, "_renameat2", None)
    elif emit_dir._renameat2 is None:
        pytest.skip("this platform has no renameat2")
    return request.param


def test_a_failure_at_any_step_leaves_the_old_directory_and_no_temporary_one(tmp_path, monkeypatch, exchange):
    out = tmp_path / "out"
    for k in range(1, 10):
        emit_dir.write_directory(str(out), _fill("old"), force=True)
        with monkeypatch.context() as patch:
            failed = _failing_at(patch, k, lambda: (_ for _ in ()).throw(OSError("injected")))
            try:
                emit_dir.write_directory(str(out), _fill("new"), force=True)
                moved = True
            except OSError as exc:
                assert str(exc) == "injected"
                moved = False
        assert _tree(out) == {"version.txt": "new" if moved else "old"}, (k, failed)
        if failed != ["_remove"]:  # a removal that failed is left to the next emit
            assert _leftovers(tmp_path) == [], (k, failed)
        emit_dir.recover(str(out))
        assert _leftovers(tmp_path) == [], (k, failed)
        if not failed:
            break
    assert not failed, "the move never finished within the steps tried"


def test_a_failed_real_emit_between_the_renames_keeps_the_old_emission(rewritten, tmp_path, monkeypatch):
    out = tmp_path / "out"
    emit(rewritten, out)
    before = _tree_bytes(out)
    monkeypatch.setattr(emit_dir, "_renameat2", None)
    renames = [0]
    rename = os.rename

    def second_fails(*args):
        renames[0] += 1
        if renames[0] == 2:  # the new directory into place, after the old one was moved aside
            raise OSError("injected")
        return rename(*args)

    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(OSError, match="injected"):
        emit(rewritten, out, force=True)
    assert _tree_bytes(out) == before
    assert _leftovers(tmp_path) == []


def _tree_bytes(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def _crash_in_child(out: str, k: int) -> bool:
    """Run the move in a forked child that ends at its k-th step (True) or finishes (False)."""
    pid = os.fork()
    if pid == 0:
        try:
            import pytest as child_pytest

            with child_pytest.MonkeyPatch.context() as patch:
                _failing_at(patch, k, lambda: os._exit(99))
                emit_dir.write_directory(out, _fill("new"), force=True)
            os._exit(0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 99), code
    return code == 99


def test_a_crash_at_any_step_leaves_the_old_emission_or_the_new_one(tmp_path, exchange):
    out = tmp_path / "out"
    restored = []
    for k in range(1, 10):
        emit_dir.write_directory(str(out), _fill("old"), force=True)
        crashed = _crash_in_child(str(out), k)
        notes = emit_dir.recover(str(out))  # what the next emit does first
        assert _tree(out) in ({"version.txt": "old"}, {"version.txt": "new"}), (k, notes)
        assert _leftovers(tmp_path) == [], (k, notes)
        if any("restored" in note for note in notes):
            restored.append(k)
            assert _tree(out) == {"version.txt": "old"}
        if not crashed:
            break
    assert not crashed, "the move never finished within the steps tried"
    if exchange == "two renames":  # a crash between them leaves no directory until the next emit
        assert restored, "no crash point left the old directory aside"


def test_stale_temporary_directories_are_removed_only_when_their_process_is_gone(tmp_path):
    out = tmp_path / "out"
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f".out.{emit_dir.TAG}-{gone.pid}-abcdefgh"
    running = tmp_path / f".out.{emit_dir.TAG}-{os.getppid()}-abcdefgh"
    other = tmp_path / ".out.someone-elses"
    for path in (stale, running, other):
        path.mkdir()
        (path / "model.safetensors").write_text("weights")
    notes = emit_dir.recover(str(out))
    assert not stale.exists() and running.exists() and other.exists()
    assert any(str(stale) in note for note in notes), notes


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_emitted_directory_follows_the_umask(rewritten, tmp_path, umask):
    previous = os.umask(umask)
    try:
        emit(rewritten, tmp_path / "out")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
