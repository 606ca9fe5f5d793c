"""The Hugging Face Hub: whether a name is a hub id or a path on this machine (`is_hub_id`, the one rule every
command uses), and uploads, checked when the run starts so that a run fails in seconds, not hours."""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Collection
from pathlib import Path

HUB_TIMEOUT_S = 30.0
# Files of an output folder that are never uploaded at the end of a run: checkpoints (pushed by --hub_strategy),
# the merged model (a full copy of the base, not an adapter's content) and temporary or hidden files.
END_IGNORE = ["checkpoints/*", "merged/*", ".*", "*/.*", "*.tmp-*"]


def is_hub_id(ref: str | None, *, file_suffixes: Collection[str] = ()) -> bool:
    """Whether `ref` names a hub repository (`name` or `org/name`) rather than a path on this machine.

    A path is anything that exists here (a folder named like a hub id included: transformers and datasets load
    the local copy first), starts with `.`, `/` or `~`, or is no valid repository id by the hub's own rule
    (huggingface_hub's validate_repo_id: `a/b/c`, a backslash, spaces, `--`, ...). `file_suffixes`: names ending
    in one of these (case-insensitive) are files, e.g. a data set's `.jsonl` that is missing, not a repository.
    Everything that is not a hub id is a local path (`not is_hub_id(ref)`).
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not ref or ref.startswith((".", "/", "~")) or Path(ref).expanduser().exists():
        return False
    if file_suffixes and Path(ref).suffix.lower() in file_suffixes:
        return False
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def preflight(
    *,
    push_to_hub: bool,
    hub_model_id: str | None,
    output_dir: str,
    hub_token: str | None,
    hub_private_repo: bool | None,
    timeout_s: float = HUB_TIMEOUT_S,
) -> str | None:
    """Check the token and create (or find) the repository; return its id, or None when not pushing.

    Runs before any data or model is loaded, and each hub call is bounded by timeout_s, so that a missing token,
    an unreachable hub or a read-only token stop the run in seconds. Raises ValueError saying which.
    """
    if not push_to_hub:
        return None
    from huggingface_hub import HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise ValueError("--push_to_hub: HF_HUB_OFFLINE=1 is set, so nothing can be uploaded; unset it.")
    token = hub_token or get_token()
    if not token:
        raise ValueError(
            "--push_to_hub needs a Hugging Face token with write access and none was found: pass --hub_token, "
            "set HF_TOKEN, or log in with `hf auth login` (or drop --push_to_hub)."
        )
    api = HfApi(token=token)
    user = _hub_call(api.whoami, "check the token", api.endpoint, timeout_s)
    role = ((user.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise ValueError(
            f"--push_to_hub: the token of {user.get('name')} is read-only; create a token with write access "
            "(https://huggingface.co/settings/tokens) and pass it with --hub_token or HF_TOKEN."
        )
    repo_id = hub_model_id or f"{user['name']}/{Path(output_dir).resolve().name}"
    _hub_call(
        lambda: api.create_repo(repo_id, private=bool(hub_private_repo), exist_ok=True),
        f"create or access the repository {repo_id} (--hub_model_id)",
        api.endpoint,
        timeout_s,
    )
    return repo_id


def _hub_call(fn, what: str, endpoint: str, timeout_s: float):
    """fn() in a daemon thread, so that a hub that never answers cannot hold the run (the HTTP client has no
    timeout of its own); errors become ValueErrors that say whether the hub was unreachable or refused."""

    from huggingface_hub.errors import HfHubHTTPError

    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="shardtune-hub-preflight", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ValueError(
            f"--push_to_hub: cannot reach the Hugging Face Hub at {endpoint}: no answer within {timeout_s:.0f} s "
            f"while trying to {what}. Check the network, HF_ENDPOINT and any proxy, or drop --push_to_hub."
        )
    e = box.get("error")
    if e is None:
        return box.get("value")
    if isinstance(e, HfHubHTTPError) and e.response is not None:
        status = e.response.status_code
        hint = {
            401: "the token is invalid or expired: pass a valid one with --hub_token or HF_TOKEN.",
            403: "the token is not allowed to do this: it needs write access to the repository's namespace.",
        }.get(status, "see the message above.")
        raise ValueError(f"--push_to_hub: the Hugging Face Hub refused to {what} (HTTP {status}: {e}); {hint}") from e
    if isinstance(e, (OSError, ConnectionError, TimeoutError)) or is_transport_error(e):
        raise ValueError(
            f"--push_to_hub: cannot reach the Hugging Face Hub at {endpoint} to {what} ({type(e).__name__}: {e}). "
            "Check the network, HF_ENDPOINT and any proxy, or drop --push_to_hub."
        ) from e
    raise e


def is_transport_error(e: BaseException) -> bool:
    """Connection, DNS, TLS and proxy failures of huggingface_hub's HTTP client: httpx2 (huggingface_hub 2.x) or
    httpx (1.x), whose errors are not OSErrors (requests', in older releases, are)."""

    for client in ("httpx2", "httpx"):
        try:
            mod = importlib.import_module(client)
        except ImportError:
            continue
        if isinstance(e, mod.TransportError):
            return True
    return False


def upload(
    repo_id: str,
    folder: str | Path,
    *,
    hub_token: str | None,
    message: str,
    path_in_repo: str | None = None,
    ignore: list[str] | None = None,
) -> str:
    """Upload a folder (the adapter or a checkpoint) to the repository; return the commit's URL.

    A failed upload raises ValueError with the command that retries it: the files stay where they are.
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"cannot upload {folder} to {repo_id}: no such folder.")
    try:
        info = HfApi(token=hub_token).upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            path_in_repo=path_in_repo,
            commit_message=message,
            ignore_patterns=list(ignore) if ignore else None,  # upload_folder appends to the list it is given
        )
    except Exception as e:
        if not (isinstance(e, OSError) or is_transport_error(e)):
            raise
        target = f" {path_in_repo}" if path_in_repo else ""
        raise ValueError(
            f"upload of {folder} to https://huggingface.co/{repo_id} failed ({type(e).__name__}: {e}). The files are "
            f"intact; upload them later with `hf upload {repo_id} {folder}{target}`."
        ) from e
    return str(info.commit_url)


CHECKPOINT_STRATEGIES = ("every_save", "checkpoint", "all_checkpoints", "end")
POINTER_FILE = "last_checkpoint.json"


def push_checkpoint(
    repo_id: str,
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    *,
    strategy: str,
    hub_token: str | None,
    step: int,
) -> list[str]:
    """Upload after a checkpoint save, as --hub_strategy says; return the commit URLs (none for `end`).

    every_save: the files at the top of output_dir (the adapter or model as of this step, tokenizer, card, metrics)
    and `last_checkpoint.json`, which names the checkpoint; checkpoint: also the checkpoint folder, as
    `last-checkpoint/` (files of the previous one that it lacks are deleted); all_checkpoints: also the checkpoint
    folder under its own name, `checkpoint-<step>/`. A failed upload raises ValueError; the local files are intact.
    """
    if strategy not in CHECKPOINT_STRATEGIES:
        raise ValueError(f"--hub_strategy {strategy!r}: use one of {', '.join(CHECKPOINT_STRATEGIES)}.")
    if strategy == "end":
        return []

    from huggingface_hub import CommitOperationAdd, HfApi

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    api = HfApi(token=hub_token)
    urls = []
    in_repo = {"checkpoint": "last-checkpoint", "all_checkpoints": checkpoint_dir.name}.get(strategy)
    if in_repo:
        urls.append(
            _push(
                lambda: api.upload_folder(
                    repo_id=repo_id,
                    folder_path=str(checkpoint_dir),
                    path_in_repo=in_repo,
                    commit_message=f"shardtune: checkpoint at step {step}",
                    delete_patterns=["*"] if strategy == "checkpoint" else None,
                ),
                repo_id,
                checkpoint_dir,
            )
        )
    pointer = {"step": step, "checkpoint": str(checkpoint_dir.relative_to(output_dir)), "path_in_repo": in_repo}
    ops = [
        CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f))
        for f in sorted(output_dir.iterdir())
        if f.is_file() and not f.name.startswith((".", "_")) and f.name != POINTER_FILE
    ]
    ops.append(CommitOperationAdd(path_in_repo=POINTER_FILE, path_or_fileobj=json.dumps(pointer, indent=2).encode()))
    commit = _push(
        lambda: api.create_commit(repo_id=repo_id, operations=ops, commit_message=f"shardtune: step {step}"),
        repo_id,
        output_dir,
    )
    urls.append(commit)
    return urls


def _push(fn, repo_id: str, folder: Path) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    try:
        result = fn()
    except Exception as e:
        if not (isinstance(e, (OSError, HfHubHTTPError)) or is_transport_error(e)):
            raise
        raise ValueError(
            f"upload of {folder} to https://huggingface.co/{repo_id} failed ({type(e).__name__}: {e}); the files "
            f"are intact: upload them later with `hf upload {repo_id} {folder}`."
        ) from e
    return str(getattr(result, "commit_url", result))
