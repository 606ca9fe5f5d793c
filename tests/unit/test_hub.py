"""Hub checks at the start of a run and the end-of-run upload, without the real hub.

A small HTTP server on 127.0.0.1 stands in for the hub's whoami and create-repo endpoints; huggingface_hub talks
to it through HF_ENDPOINT. The CLI tests check that `shardtune train --push_to_hub` stops before loading anything.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from shardtune.runtime import hub
from tests.conftest import _free_port, run_cli


class _Hub(BaseHTTPRequestHandler):
    whoami: ClassVar[tuple[int, dict]] = (200, {})
    create: ClassVar[tuple[int, dict]] = (200, {})
    requests: ClassVar[list[tuple[str, str, dict]]] = []

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.requests.append(("GET", self.path, {}))
        self._reply(*self.whoami) if self.path == "/api/whoami-v2" else self._reply(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.requests.append(("POST", self.path, body))
        self._reply(*self.create) if self.path == "/api/repos/create" else self._reply(404, {"error": "not found"})

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_hub(monkeypatch):
    """A hub at http://127.0.0.1:<port> answering as user `alice` with a write token, unless a test says otherwise."""
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _Hub.whoami = (200, {"name": "alice", "auth": {"accessToken": {"role": "write"}}})
    _Hub.create = (200, {"url": f"{url}/alice/run1"})
    _Hub.requests = []
    monkeypatch.setattr(constants, "ENDPOINT", url)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield url
    server.shutdown()
    server.server_close()


def _preflight(output_dir="out/run1", token="hf_test", model_id=None, private=None, timeout_s=10.0):
    return hub.preflight(
        push_to_hub=True,
        hub_model_id=model_id,
        output_dir=str(output_dir),
        hub_token=token,
        hub_private_repo=private,
        timeout_s=timeout_s,
    )


def test_not_pushing_touches_nothing(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", None)  # any use would raise
    assert (
        hub.preflight(push_to_hub=False, hub_model_id="x/y", output_dir="o", hub_token=None, hub_private_repo=None)
        is None
    )


def test_preflight_creates_the_repository_named_after_the_output_dir(stub_hub, tmp_path):
    assert _preflight(tmp_path / "run1", private=True) == "alice/run1"
    posts = [r for r in _Hub.requests if r[0] == "POST"]
    assert posts == [("POST", "/api/repos/create", {"name": "run1", "organization": "alice", "visibility": "private"})]


def test_preflight_uses_hub_model_id(stub_hub):
    _Hub.create = (200, {"url": f"{stub_hub}/team/my-adapter"})
    assert _preflight(model_id="team/my-adapter") == "team/my-adapter"
    assert [r[2].get("organization") for r in _Hub.requests if r[0] == "POST"] == ["team"]


@pytest.mark.parametrize(
    ("whoami", "create", "message"),
    [
        ((401, {"error": "Invalid credentials"}), None, r"refused to check the token \(HTTP 401.*invalid or expired"),
        ((200, {"name": "alice", "auth": {"accessToken": {"role": "read"}}}), None, "read-only.*write access"),
        (None, (403, {"error": "no write access"}), r"create or access the repository alice/run1.*HTTP 403"),
    ],
)
def test_preflight_says_what_the_hub_refused(stub_hub, whoami, create, message):
    if whoami:
        _Hub.whoami = whoami
    if create:
        _Hub.create = create
    with pytest.raises(ValueError, match=message):
        _preflight()


def test_preflight_without_token(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ValueError, match=r"needs a Hugging Face token.*--hub_token.*HF_TOKEN.*hf auth login"):
        _preflight(token=None)


def test_preflight_when_the_hub_never_answers(monkeypatch):
    """A server that accepts the connection and stays silent: stopped by the timeout, not after hours."""
    from huggingface_hub import constants

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.perf_counter()
        with pytest.raises(ValueError, match=r"cannot reach the Hugging Face Hub at http://127.0.0.1:\d+: no answer"):
            _preflight(timeout_s=1.0)
        assert time.perf_counter() - start < 5


def test_preflight_when_nothing_listens(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(
        ValueError, match=r"cannot reach the Hugging Face Hub at http://127.0.0.1:\d+ to check the token"
    ):
        _preflight()


def _fake_output(root: Path) -> Path:
    """The files a LoRA run with checkpoints and --merge_adapter leaves in output_dir."""
    files = [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "metrics.jsonl",
        "train_summary.json",
        "runs/events.out.tfevents.1",
        "checkpoints/checkpoint-2/meta.json",
        "checkpoints/checkpoint-2/model/__0_0.distcp",
        "merged/model.safetensors",
        "merged/README.md",
        ".adapter.tmp-123/adapter_model.safetensors",
        "runs/.hidden",
    ]
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("x")
    return root


def test_end_upload_sends_the_adapter_and_card_only(tmp_path, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    calls = []

    def fake_upload_folder(self, **kwargs):
        calls.append(kwargs)
        return type("CommitInfo", (), {"commit_url": f"https://hub/{kwargs['repo_id']}/commit/1"})()

    monkeypatch.setattr(HfApi, "upload_folder", fake_upload_folder)
    out = _fake_output(tmp_path / "run1")
    ignore = list(hub.END_IGNORE)
    url = hub.upload("alice/run1", out, hub_token="hf_test", message="end", ignore=hub.END_IGNORE)
    assert url == "https://hub/alice/run1/commit/1"
    assert hub.END_IGNORE == ignore  # not extended by huggingface_hub's own patterns
    (kw,) = calls
    assert (kw["repo_id"], kw["folder_path"], kw["commit_message"]) == ("alice/run1", str(out), "end")
    # What huggingface_hub selects with these patterns (the same function upload_folder uses).
    paths = sorted(p.relative_to(out).as_posix() for p in out.glob("**/*") if p.is_file())
    sent = set(filter_repo_objects(paths, ignore_patterns=[*kw["ignore_patterns"], *DEFAULT_IGNORE_PATTERNS]))
    assert sent == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "metrics.jsonl",
        "train_summary.json",
        "runs/events.out.tfevents.1",
    }


def test_failed_upload_says_how_to_retry(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    try:
        import httpx2 as client  # huggingface_hub 2.x
    except ImportError:
        import httpx as client  # huggingface_hub 1.x

    def refused(self, **kwargs):
        raise client.ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(HfApi, "upload_folder", refused)
    with pytest.raises(ValueError, match=r"failed \(ConnectError.*intact.*`hf upload alice/run1 .*run1 last`"):
        hub.upload("alice/run1", _fake_output(tmp_path / "run1"), hub_token=None, message="m", path_in_repo="last")
    with pytest.raises(ValueError, match="no such folder"):
        hub.upload("alice/run1", tmp_path / "missing", hub_token=None, message="m")


def _train_args(assets, out: Path) -> list[str]:
    return [
        "train",
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets["data"]),
        "--use_peft_lora",
        "True",
        "--max_steps",
        "1",
        "--output_dir",
        str(out),
        "--push_to_hub",
        "True",
    ]


@pytest.mark.parametrize("case", ["no_token", "unreachable"])
def test_train_with_push_to_hub_fails_before_loading(tiny_assets, tmp_path, case):
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0"}
    if case == "unreachable":
        env.update(HF_TOKEN="hf_not_a_real_token", HF_ENDPOINT=f"http://127.0.0.1:{_free_port()}")
    start = time.perf_counter()
    proc = run_cli(_train_args(tiny_assets, tmp_path / "out"), env=env, check=False, timeout=120)
    elapsed = time.perf_counter() - start
    err = proc.stdout + proc.stderr
    assert proc.returncode == 2, err[-3000:]
    if case == "no_token":
        assert "--push_to_hub needs a Hugging Face token" in err and "--hub_token" in err
    else:
        assert "cannot reach the Hugging Face Hub at http://127.0.0.1:" in err
    # Stopped before the data and the model were loaded.
    assert "Data:" not in err and "Model:" not in err and "Traceback" not in err
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert elapsed < 60, elapsed
