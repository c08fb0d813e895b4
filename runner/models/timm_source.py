"""timm models by name (`model=timm model.name=convnext_tiny`), with a pretrained tag's weights from the Hugging
Face cache, timm's own preprocessing and the ImageNet class names. timm is imported only when a model is built."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from runner.errors import RunnerError, suggest
from runner.models.base import ModelBundle, ModelSource, Preprocess, hub_cache_dir, hub_offline
from runner.schema import ModelConfig

log = logging.getLogger(__name__)

# `model.weights` values that mean "the architecture's default pretrained tag" (true arrives as the string "True").
DEFAULT_TAGS = ("DEFAULT", "true", "True", "TRUE")


def _timm() -> Any:
    try:
        import timm
    except ImportError as e:
        raise RunnerError(
            "model=timm needs the timm package: pip install 'runner[models]' (or pip install timm)."
        ) from e
    return timm


class TimmSource(ModelSource):
    accepts = "a timm model name with model=timm"

    def known_names(self) -> list[str]:
        return list(_timm().list_models())

    def build(self, cfg: ModelConfig) -> ModelBundle:
        if not cfg.name:
            raise RunnerError("model=timm needs model.name=NAME: a timm model name, e.g. model.name=convnext_tiny.")
        timm = _timm()
        architecture, name_tag = timm.models.split_model_name_tag(cfg.name)
        if not timm.is_model(architecture):
            raise RunnerError(
                f"Unknown timm model '{architecture}'.{suggest(architecture, timm.list_models())} model=timm takes"
                " any name of timm.list_models() (optionally with a pretrained tag: convnext_tiny.fb_in1k)."
            )
        tag = _weights_tag(cfg.weights, name_tag)
        if tag is None:  # random init, on purpose only; an explicit tag in the name still sets the class count
            model = timm.create_model(cfg.name, pretrained=False, **cfg.kwargs)
            return ModelBundle(model, None, None)
        full = f"{architecture}.{tag}" if tag else architecture
        tags = timm.list_pretrained(f"{architecture}.*")
        if (full not in tags) if tag else not tags:
            valid = ", ".join(t.split(".", 1)[1] for t in tags) or "none"
            raise RunnerError(
                f"timm model '{architecture}' has no pretrained weights '{tag or 'DEFAULT'}'. Valid tags: {valid}; DEFAULT for"
                " the default one, or model.weights=null for random initialisation."
            )
        file = _pretrained_file(timm, full)
        try:
            model = timm.create_model(
                full, pretrained=True, pretrained_cfg_overlay={"file": file, "source": ""}, **cfg.kwargs
            )
        except RunnerError:
            raise
        except Exception as e:  # a damaged file in the cache, or kwargs the weights do not fit
            raise RunnerError(
                f"Cannot load timm weights {full} from {file} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
            ) from e
        return ModelBundle(model, _preprocess(timm, model), _class_names(timm, model))


def _weights_tag(weights: str | None, name_tag: str) -> str | None:
    """The pretrained tag to load ('' for the architecture's default), or None for random init."""
    if weights is None:
        return None
    if weights in DEFAULT_TAGS:
        return name_tag
    if name_tag and weights != name_tag:
        raise RunnerError(
            f"model.name has the tag '{name_tag}' and model.weights says '{weights}': give the tag in one of them."
        )
    return weights


def _pretrained_file(timm: Any, full: str) -> str:
    """The local path of a timm pretrained tag's weights: from the Hugging Face cache, else downloaded into it
    (not with HF_HUB_OFFLINE=1); never a silent random fallback."""
    cfg = timm.models.get_pretrained_cfg(full)
    repo = getattr(cfg, "hf_hub_id", None)
    if not repo:
        raise RunnerError(
            f"timm weights {full} are not on the Hugging Face Hub (url: {getattr(cfg, 'url', None)}): download the"
            " file, then use model.weights=null model.checkpoint=PATH."
        )
    repo, _, revision = repo.partition("@")
    names = (
        [cfg.hf_hub_filename] if getattr(cfg, "hf_hub_filename", None) else ["model.safetensors", "pytorch_model.bin"]
    )
    import huggingface_hub

    for name in names:
        cached = huggingface_hub.try_to_load_from_cache(repo, name, revision=revision or None)
        if isinstance(cached, str):
            return cached
    error: Exception | None = None
    if not hub_offline():
        for name in names:
            try:
                return str(huggingface_hub.hf_hub_download(repo, name, revision=revision or None))
            except Exception as e:  # offline: LocalEntryNotFoundError after retries; a missing file: EntryNotFound
                error = error or e
    why = f" ({type(error).__name__})" if error else " (HF_HUB_OFFLINE=1: no download tried)"
    raise RunnerError(
        f"timm weights {full} are not in the Hugging Face cache {hub_cache_dir()}{why}. Place {names[0]} of the"
        f" Hub repo {repo} there (with internet: `hf download {repo} {names[0]}`, then copy"
        f" {Path(hub_cache_dir()) / ('models--' + repo.replace('/', '--'))}), or run with model.weights=null for"
        " random initialisation."
    )


def _preprocess(timm: Any, model: Any) -> Preprocess:
    """timm's evaluation transform for the model's pretrained config (resize, centre crop, its mean and std)."""
    config = timm.data.resolve_data_config(model=model)
    transform = timm.data.create_transform(**config)
    size = config["input_size"][-1]
    resize = int(size / config.get("crop_pct", 1.0)) if config.get("crop_mode", "center") == "center" else size
    height, width = config["input_size"][-2:]
    return Preprocess(transform, config["mean"], config["std"], resize, size, height if height == width else None)


def _class_names(timm: Any, model: Any) -> list[str] | None:
    """The ImageNet names of the pretrained classes (torchvision's short names for ImageNet-1k, as the other
    sources give), or None when the weights are not ImageNet's."""
    subset = timm.data.infer_imagenet_subset(model)
    if subset is None:
        return None
    if subset in ("imagenet-1k", "imagenet1k"):
        import torchvision

        names = list(torchvision.models.ResNet50_Weights.IMAGENET1K_V1.meta["categories"])
    else:
        names = [d.split(",")[0] for d in timm.data.ImageNetInfo(subset).label_descriptions()]
    return names if len(names) == getattr(model, "num_classes", len(names)) else None
