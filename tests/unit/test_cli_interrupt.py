"""A Ctrl-C while a command starts, in the ways libraries' imports mishandle it: `cli.main` reports each as one
line and exit code 3, and puts the caller's SIGINT handler back."""

from __future__ import annotations

import os
import signal
import sys
import types

import pytest

from shardtune import cli


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
