"""The README.md model card written beside the weights."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

TAGS = ["mlx", "deepseek_v2", "mla", "mlx-mla"]


def _source_card_data(source: Path) -> dict:
    """License and language from the source's own card, when it has one."""
    readme = Path(source) / "README.md"
    if not readme.is_file():
        return {}
    try:
        data = ModelCard.load(readme).data
    except Exception:  # a card without valid metadata is common and harmless here
        return {}
    return {k: getattr(data, k) for k in ("license", "language") if getattr(data, k, None)}


def write_model_card(
    folder: Path,
    name: str,
    source: Path,
    base_model: str | None,
    repo_id: str | None,
    quantization: str,
    details: str = "",
) -> None:
    """Write `folder/README.md`: Hub metadata (library_name mlx, base_model, tags) and usage.

    Args:
        base_model: the Hub id converted from, or None for a local folder (the Hub's
            base_model field must be a Hub id).
        name: the output folder's name, used in the usage snippet when `repo_id` is None.
        repo_id: where it will be uploaded, used in the usage snippet.
        quantization: a one-line description, e.g. "4-bit affine, group 64 (uniform recipe), 4.52 bits per weight".
        details: Markdown appended to the card (the quantization plan and figures).
    """
    data = ModelCardData(
        library_name="mlx",
        pipeline_tag="text-generation",
        tags=list(TAGS),
        base_model=base_model,
        **_source_card_data(source),
    )
    name = repo_id or name
    origin = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a local checkpoint"
    text = f"""# {name}

Converted to MLX format from {origin} with mlx-mla's converter (`python -m convert`).
Weights: {quantization}.

The folder is in mlx-lm's format, so stock mlx-lm loads it; mlx-mla runs it with a latent
(MLA) KV cache.

```bash
pip install mlx-lm
mlx_lm.generate --model {name} --prompt "hello"
```

```python
import mlx_mla

model, tokenizer = mlx_mla.load("{name}")
```
"""
    if details:
        text += "\n" + details
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}")
    card.save(Path(folder) / "README.md")
