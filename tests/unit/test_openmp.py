"""How OpenMP threads wait (shardtune.config.openmp): they sleep at once on a machine other processes keep busy,
OpenMP's default stays on an idle one, the user's choice is kept, and the choice is made before torch loads libgomp
and inherited by child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardtune.config import openmp


def _without_torch(monkeypatch):
    """apply_default as a fresh `shardtune` process sees it: torch not loaded yet."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)


@pytest.mark.parametrize(("busy", "set_"), [(0.0, False), (0.2, False), (0.25, True), (0.5, True), (None, False)])
def test_the_threads_sleep_at_once_on_a_shared_machine(monkeypatch, busy, set_):
    _without_torch(monkeypatch)
    env = {"OMP_NUM_THREADS": "2"}
    assert openmp.apply_default(env, busy=lambda: busy) is set_
    assert env == ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"} if set_ else {"OMP_NUM_THREADS": "2"})


@pytest.mark.parametrize("choice", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1"}])
def test_the_users_choice_is_kept(monkeypatch, choice):
    _without_torch(monkeypatch)
    env = dict(choice)
    assert openmp.apply_default(env, busy=lambda: 1.0) is False
    assert env == choice


def test_a_rank_among_several_leaves_it_to_its_launcher(monkeypatch):
    """torchrun's workers start side by side: each would count the others as jobs sharing the machine."""
    _without_torch(monkeypatch)
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert openmp.apply_default(env, busy=lambda: 1.0) is False and env == {"LOCAL_WORLD_SIZE": "2"}


def test_nothing_is_set_once_torch_is_loaded():
    """A program calling a command in its own process: libgomp has read its settings; nothing is sampled."""
    import torch  # noqa: F401

    env: dict[str, str] = {}
    assert openmp.apply_default(env, busy=lambda: pytest.fail("sampled")) is False and env == {}


def test_the_busy_share_is_other_processes_ticks():
    """From /proc/stat's first line: (all ticks, idle + iowait ticks) twice; the share busy in between."""
    samples = iter([(1000, 800), (1200, 900)])  # 200 ticks, 100 of them idle
    assert openmp.busy_fraction(lambda: next(samples), sample_s=0) == pytest.approx(0.5)
    assert openmp.busy_fraction(lambda: (_ for _ in ()).throw(OSError("no /proc")), sample_s=0) is None


def test_a_busy_core_is_seen_and_the_choice_reaches_torch_and_children(tmp_path):
    """A fresh interpreter beside a process that keeps one core busy: `python -m shardtune`'s entry sets the policy
    before torch is imported, and a child process inherits it. Negative control: SHARED_FRACTION planted at 2.0
    (never shared), `policy` is None."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("Linux's /proc/stat")
    cpus = os.cpu_count() or 1
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(1, -(-cpus // 2)))
    ]  # half the CPUs or more busy
    script = (
        "import os, sys, json, subprocess\n"
        "from shardtune import cli\n"
        "cli.prepare_process()\n"
        "before_torch = 'torch' not in sys.modules\n"
        "import torch\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"OMP_WAIT_POLICY\"))'],\n"
        "                       capture_output=True, text=True, check=True).stdout.strip()\n"
        "print(json.dumps({'policy': os.environ.get('OMP_WAIT_POLICY'), 'before_torch': before_torch, "
        "'child': child}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in openmp.USER_CHOICES}
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"policy": "PASSIVE", "before_torch": True, "child": "PASSIVE"}
