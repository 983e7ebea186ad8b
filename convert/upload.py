"""Uploading a converted folder to the Hugging Face Hub (huggingface_hub 2.x API)."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi

from .errors import ConvertError


def upload(folder: Path, repo_id: str) -> str:
    """Create `repo_id` if needed and upload `folder` (weights, config, tokenizer, card).

    Uses `create_repo(exist_ok=True)` then `upload_folder`: the calls huggingface_hub 2.x
    keeps (mlx-lm's `upload_large_folder` is gone there).

    Returns:
        the repo's URL.
    Raises:
        ConvertError: no token, or the Hub refused or failed a request; the message keeps
            only the first line of the Hub's error.
    """
    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True, repo_type="model")
        api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload MLX model converted with mlx-mla",
        )
    except Exception as e:  # token, HTTP and network errors alike end up as one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvertError(
            f"upload to {repo_id} failed ({type(e).__name__}: {reason}); the converted model is "
            f"kept at {folder}: log in with `hf auth login` (or set HF_TOKEN) and run "
            f"`hf upload {repo_id} {folder}`"
        ) from e
    return f"https://huggingface.co/{repo_id}"
