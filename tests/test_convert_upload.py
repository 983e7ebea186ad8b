"""Upload and Hub download, faked at their boundaries (HfApi, huggingface_hub.snapshot_download)."""

from __future__ import annotations

import pytest

import huggingface_hub
import convert.upload as upload_mod
from convert_helpers import load_tensors, run_cli


class FakeApi:
    """Records HfApi calls; `fail` (an exception) is raised by the named method."""

    calls = []
    fail = {}

    def __init__(self, *a, **k):
        pass

    def create_repo(self, repo_id, **kwargs):
        FakeApi.calls.append(("create_repo", repo_id, kwargs))
        if "create_repo" in FakeApi.fail:
            raise FakeApi.fail["create_repo"]

    def upload_folder(self, **kwargs):
        FakeApi.calls.append(("upload_folder", kwargs))
        if "upload_folder" in FakeApi.fail:
            raise FakeApi.fail["upload_folder"]


@pytest.fixture
def fake_api(monkeypatch):
    FakeApi.calls, FakeApi.fail = [], {}
    monkeypatch.setattr(upload_mod, "HfApi", FakeApi)
    return FakeApi


def test_upload_calls(tmp_path, fake_api, capsys, fixture_dir):
    out = tmp_path / "out"
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q", "--upload-repo", "me/tiny-mlx") == 0
    (name, repo, kw), (name2, kw2) = fake_api.calls
    assert (name, repo) == ("create_repo", "me/tiny-mlx")
    assert kw["exist_ok"] is True and kw.get("repo_type", "model") == "model"
    assert name2 == "upload_folder"
    assert kw2["repo_id"] == "me/tiny-mlx" and str(kw2["folder_path"]) == str(out)
    card = (out / "README.md").read_text()
    assert "me/tiny-mlx" in card and "library_name: mlx" in card
    assert "https://huggingface.co/me/tiny-mlx" in capsys.readouterr().out


def _http_error():
    from huggingface_hub.errors import HfHubHTTPError

    try:
        import httpx

        req = httpx.Request("POST", "https://huggingface.co/api/repos/create")
        return HfHubHTTPError("401 Client Error: Unauthorized", response=httpx.Response(401, request=req))
    except Exception:  # a huggingface_hub whose error wants another response type
        err = HfHubHTTPError.__new__(HfHubHTTPError)
        Exception.__init__(err, "401 Client Error: Unauthorized")
        return err


@pytest.mark.parametrize("method,make_exc", [
    ("create_repo", lambda: __import__("huggingface_hub.errors", fromlist=["x"]).LocalTokenNotFoundError(
        "Token is required (`token=True`), but no token found.\nRun `hf auth login`.")),
    ("create_repo", _http_error),
    ("upload_folder", lambda: ConnectionError("connection reset by peer")),
])
def test_upload_failure_is_one_line_and_keeps_output(tmp_path, fake_api, capsys, method, make_exc, fixture_dir):
    fake_api.fail[method] = make_exc()
    out = tmp_path / "out"
    rc = run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q", "--upload-repo", "me/tiny-mlx")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert len([line for line in err if line.startswith("error:")]) == 1
    assert "upload to me/tiny-mlx failed" in err[-1] and str(out) in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert load_tensors(out)  # the local output stays, complete


def test_hub_id_goes_through_snapshot_download(tmp_path, monkeypatch, fixture_dir):
    seen = []

    def fake_download(repo_id, **kwargs):
        seen.append((repo_id, kwargs))
        return str(fixture_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    out = tmp_path / "out"
    assert run_cli("--hf-path", "deepseek-ai/DeepSeek-V2-Lite", "--mlx-path", out, "-q") == 0
    assert seen[0][0] == "deepseek-ai/DeepSeek-V2-Lite"
    assert "*.safetensors" in "".join(seen[0][1]["allow_patterns"])
    assert "base_model: deepseek-ai/DeepSeek-V2-Lite" in (out / "README.md").read_text()


def test_hub_download_failure(tmp_path, monkeypatch, capsys):
    def offline(repo_id, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    out = tmp_path / "out"
    assert run_cli("--hf-path", "deepseek-ai/DeepSeek-V2-Lite", "--mlx-path", out, "-q") != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not download deepseek-ai/DeepSeek-V2-Lite" in err[0]
    assert not out.exists()
