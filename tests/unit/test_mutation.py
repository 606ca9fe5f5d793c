"""The planting mechanism of tests/mutation.py: a planted edit reaches a subprocess, and a stale edit is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mutation import Edit, plant


def test_planted_edit_reaches_a_subprocess(tmp_path):
    env = plant(Edit("__init__.py", '__version__ = "0.1.0"', '__version__ = "planted"'), tmp_path)
    code = "import shardtune; print(shardtune.__version__, shardtune.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**_env(), **env}, capture_output=True, text=True, check=True
    )
    version, path = out.stdout.split()
    assert version == "planted" and path.startswith(str(tmp_path))
    import shardtune

    assert shardtune.__version__ == "0.1.0"  # this process keeps the real sources


def test_an_edit_whose_text_is_gone_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="0 times"):
        plant(Edit("__init__.py", "text that is not there", "x"), tmp_path)


def _env():
    import os

    return dict(os.environ)
