"""Writers (issue 14): a process killed at any point leaves the old file or the new one, and the
next run removes its temporary files; ``emit`` moves its set of files into place as a whole;
``plan --out/--html/--emit`` refuse to overwrite without ``--force`` before writing anything;
measurement temp dirs of dead processes are removed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.util.fileio import atomic_write_text, clean_stale, make_temp_dir, write_files

_WRITER = """
import sys, time
from vramplan.util import fileio
real = fileio._write_fsync
def slow(fd, data):
    real(fd, data); time.sleep(0.05)
fileio._write_fsync = slow
what, target = sys.argv[1], sys.argv[2]
print("ready", flush=True)
for i in range(1000):
    if what == "file":
        fileio.atomic_write_text(target, ("x%d" % i) * 1000)
    else:
        fileio.write_files(target, {"a.txt": b"A%d" % i, "b.txt": b"B%d" % i, "c.txt": b"C%d" % i})
"""


def _kill_at_random(what: str, target: Path, seed: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, what, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(random.Random(seed).uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_killed_file_write_leaves_a_whole_file_and_the_next_run_cleans(tmp_path):
    target = tmp_path / "plan.yaml"
    for seed in range(4):
        _kill_at_random("file", target, seed)
        if target.exists() and target.read_text() != "done":  # the old file, or one whole new one
            text = target.read_text()
            assert len(text) >= 2000 and text == text[: len(text) // 1000] * 1000
        atomic_write_text(target, "done")  # a normal run afterwards
        assert _temps(tmp_path) == []
        assert target.read_text() == "done"


def test_killed_emit_leaves_the_full_set_or_none(tmp_path):
    for seed in range(4):
        out = tmp_path / f"run{seed}"
        _kill_at_random("set", out, seed)
        if out.exists():
            names = sorted(p.name for p in out.iterdir())
            assert names == ["a.txt", "b.txt", "c.txt"], names
            stamps = {p.read_text()[1:] for p in out.iterdir()}
            assert len(stamps) == 1, stamps  # all three from the same write
        write_files(out, {"a.txt": b"a"}, frozenset())
        assert _temps(tmp_path) == []


def test_stale_temp_of_a_live_writer_is_kept(tmp_path):
    mine = tmp_path / f".x.vramplan-{os.getpid()}-abc.tmp"
    dead = tmp_path / ".x.vramplan-999999999-abc.tmp"
    mine.write_text("")
    dead.write_text("")
    assert clean_stale(tmp_path) == [dead]
    assert mine.exists()


def test_write_files_into_a_non_empty_dir_keeps_other_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "a.txt").write_text("old")
    write_files(out, {"a.txt": b"new", "run.sh": b"#!/bin/sh\n"}, frozenset({"run.sh"}))
    assert (out / "notes.txt").read_text() == "mine" and (out / "a.txt").read_text() == "new"
    assert os.access(out / "run.sh", os.X_OK)
    assert _temps(tmp_path) == []


def test_measure_temp_dirs_of_dead_processes_are_removed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / "vramplan-measure-999999999-abcd"
    stale.mkdir()
    (stale / "log").write_text("x")
    other = tmp_path / "someone-else"
    other.mkdir()
    fresh = make_temp_dir("measure")
    assert not stale.exists() and other.exists() and fresh.is_dir()
    assert fresh.name.startswith(f"vramplan-measure-{os.getpid()}-")


def test_plan_refuses_to_overwrite_without_force_and_writes_nothing(tmp_path):
    out, html, emit_dir = tmp_path / "p.yaml", tmp_path / "r.html", tmp_path / "run"
    emit_dir.mkdir()
    (emit_dir / "keep").write_text("x")
    args = ["plan", "smollm2-135m", "--gpu", "l4", "--seq", "512"]
    r = CliRunner().invoke(main, [*args, "--out", str(out), "--html", str(html), "--emit", str(emit_dir)])
    assert_user_error(r, "--force")
    assert not out.exists() and not html.exists()  # refused before writing either
    r = CliRunner().invoke(main, [*args, "--out", str(out), "--html", str(html)])
    assert r.exit_code == 0, r.output
    first = out.read_text()
    out.write_text("edited by hand")
    r = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert_user_error(r, "--force", str(out))
    assert out.read_text() == "edited by hand"
    r = CliRunner().invoke(main, [*args, "--out", str(out), "--force"])
    assert r.exit_code == 0 and out.read_text() == first


def test_emit_ignores_nothing_left_by_a_killed_run(tmp_path):
    """A stale staging dir next to DIR is not inside DIR: emit without --force still works."""
    plan = tmp_path / "p.yaml"
    assert CliRunner().invoke(main, ["plan", "smollm2-135m", "--gpu", "l4", "--seq", "512",
                                     "--out", str(plan)]).exit_code == 0
    (tmp_path / ".run.vramplan-999999999-x.tmp").mkdir()
    r = CliRunner().invoke(main, ["emit", str(plan), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert _temps(tmp_path) == []


_LAUNCHER = """
import sys
from pathlib import Path
from vramplan.run.launch import _start
proc = _start([sys.executable, "-c", "import time; time.sleep(60)"], Path(sys.argv[1]), {})
print(proc.pid, flush=True)
import time; time.sleep(60)
"""


def test_a_worker_dies_with_its_killed_launcher(tmp_path):
    """kill -9 of `vramplan measure` skips every cleanup: the worker must not outlive it."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path / "w.log")], stdout=subprocess.PIPE,
                                text=True)
    worker = int(launcher.stdout.readline())
    assert (tmp_path / "tmp").is_dir()  # the worker's TMPDIR is inside the run's directory
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    for _ in range(100):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError("the worker outlived its launcher")


def test_sweep_temp_dirs_are_pid_named_and_dead_ones_are_removed(tmp_path, monkeypatch):
    import tempfile

    from vramplan.calibration import sweep

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / "vramplan-scaled-999999999-abcd"
    stale.mkdir()
    seen = []
    real = sweep.TempDir.__enter__

    def enter(self):
        seen.append(Path(real(self)).name)
        return str(self.path)

    monkeypatch.setattr(sweep.TempDir, "__enter__", enter)
    assert sweep._scaled_spec("llama-3.2-1b").num_layers > 0
    assert not stale.exists()
    assert [n.startswith(f"vramplan-scaled-{os.getpid()}-") for n in seen] == [True]
    assert list(tmp_path.iterdir()) == []  # its own directory is gone too


_FORKING_WORKER = """
import sys, time
from vramplan.run import worker
worker._run_and_write = lambda request: time.sleep(60) or 0  # a measurement that outlives the worker
print(worker._fork({}, {}), flush=True)
time.sleep(60)
"""


def test_a_forked_child_dies_with_its_killed_worker():
    """The forking worker (run_many) killed outright: its children must not outlive it."""
    parent = subprocess.Popen([sys.executable, "-c", _FORKING_WORKER], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the forked child outlived its worker")
