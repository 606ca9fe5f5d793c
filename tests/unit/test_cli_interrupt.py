"""A Ctrl-C while a command starts, in the ways libraries' imports mishandle it: `cli.main` reports each as one
line and exit code 3, and puts the caller's SIGINT handler back."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import types

import pytest

from shardtune import cli
from shardtune.runtime import signals, stop


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


def _wrapped(argv):
    """A lazy import that turns the KeyboardInterrupt into its own error without chaining it."""
    try:
        _ctrl_c()
    except KeyboardInterrupt:
        pass
    raise RuntimeError("could not import the kernels; are this object's requirements defined correctly?")


def _swallowed(argv):
    """A library that catches the KeyboardInterrupt (BaseException) and goes on."""
    try:
        _ctrl_c()
    except BaseException:  # noqa: BLE001, S110 - the library behaviour this test stands for
        pass
    return 0


def _in_finalizer(argv):
    """The signal lands in a `__del__`, where Python prints the exception as unraisable and goes on."""

    class Dies:
        def __del__(self):
            _ctrl_c()

    Dies()
    return 0


def _fails(argv):
    raise RuntimeError("a real error")


@pytest.fixture
def command(monkeypatch):
    def install(func):
        module = types.ModuleType("fake_command")
        module.main = func
        monkeypatch.setitem(sys.modules, "fake_command", module)
        monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_command", "main", "a test command"))

    return install


@pytest.mark.parametrize("func", [_wrapped, _swallowed, _in_finalizer])
def test_a_mishandled_ctrl_c_is_one_line_and_exit_3(command, capsys, func):
    command(func)
    before, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    assert cli.main(["fake"]) == 3
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and "shardtune fake: interrupted while starting" in err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert signal.getsignal(signal.SIGINT) is before
    assert sys.unraisablehook is hook


def test_an_error_without_a_ctrl_c_is_raised(command):
    """Control: the same path does not turn a real error into an interrupt."""
    command(_fails)
    with pytest.raises(RuntimeError, match="a real error"):
        cli.main(["fake"])


def _bytecodes():
    for _ in range(200_000):  # at any of which a signal handler can run
        pass


@pytest.fixture
def signalling_module(tmp_path, monkeypatch):
    """A module whose import sends `signum` to this process and goes on with its own code, as a C extension's
    initialiser calling back into Python would be interrupted. `make(signum)` returns a command that imports it and
    then waits; `completed` lists what ran to its end."""
    monkeypatch.syspath_prepend(str(tmp_path))
    completed: list[str] = []
    monkeypatch.setattr(sys.modules[__name__], "_completed", completed, raising=False)

    def make(signum: int):
        name = f"signals_on_import_{int(signum)}"
        (tmp_path / f"{name}.py").write_text(
            f"import os, sys\nos.kill(os.getpid(), {int(signum)})\nmod = sys.modules[{__name__!r}]\n"
            "mod._bytecodes()\nmod._completed.append('import')\n"
        )
        monkeypatch.delitem(sys.modules, name, raising=False)

        def run():
            __import__(name)
            completed.append("after")
            time.sleep(30)  # the signal, sent again, ends this wait
            completed.append("slept")

        return run

    return make, completed


@pytest.mark.parametrize("planted", [False, True])
def test_a_ctrl_c_inside_an_import_is_raised_once_the_import_has_ended(
    command, capsys, signalling_module, monkeypatch, planted
):
    """Inside an import the KeyboardInterrupt waits for the import's end (raised in code a C extension called, it
    aborts the process); it then interrupts what follows, a blocking wait included. Planted: raised at once, inside
    the module's code."""
    make, completed = signalling_module
    if planted:
        monkeypatch.setattr(signals, "importing", lambda frame: False)
    run = make(signal.SIGINT)
    command(lambda argv: run())
    assert cli.main(["fake"]) == 3
    assert "interrupted while starting" in capsys.readouterr().err
    assert completed == ([] if planted else ["import", "after"])


@pytest.mark.parametrize("planted", [False, True])
def test_a_stop_inside_an_import_is_raised_once_the_import_has_ended(signalling_module, monkeypatch, planted):
    """The run's StopHandler the same way, for SIGTERM."""
    make, completed = signalling_module
    if planted:
        monkeypatch.setattr(signals, "importing", lambda frame: False)
    run = make(signal.SIGTERM)
    handler = stop.StopHandler().install()
    try:
        with pytest.raises(stop.Stopped, match="SIGTERM while starting"):
            run()
    finally:
        handler.restore()
    assert completed == ([] if planted else ["import", "after"])


@pytest.mark.parametrize("planted", [False, True])
def test_a_stop_a_finalizer_swallowed_is_raised_again(capsys, monkeypatch, planted):
    """SIGTERM while a finalizer runs: Python cannot pass the Stopped on from there (it prints "Exception ignored"
    and goes on), so it is raised again right after, and the wait that follows ends. Planted: never raised again,
    the run goes on as if no stop had come."""
    if planted:
        monkeypatch.setattr(signals.Redelivery, "again", lambda self, signum: None)

    class Dies:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            _bytecodes()

    completed = []
    handler = stop.StopHandler().install()
    try:
        with pytest.raises(stop.Stopped) if not planted else contextlib.nullcontext():
            Dies()
            completed.append("after")
            time.sleep(30 if not planted else 1)
            completed.append("slept")
    finally:
        handler.restore()
    assert completed == (["after", "slept"] if planted else ["after"])
    assert "Exception ignored" not in capsys.readouterr().err
