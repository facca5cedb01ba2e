"""Weights in, versions out: the trainer's float32 master weights and AdamW, loaded from a policy version
whatever dtype it is stored in, and new versions written in the operator's dtype (``model_dtype``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from veriroll.coordinator.config import TrainerConfig
from veriroll.coordinator.trainer.step import check_packing_attention

__all__ = ["ADAM_BETAS", "attention_for", "build_optimizer", "load_training_model", "measure_publish", "write_policy_version"]

ADAM_BETAS = (0.9, 0.99)  # as in the measured tiny-GRPO recipe (benchmarks/warm_start.py)


def attention_for(setting: str, device: torch.device | str = "cpu") -> str | None:
    """The attention implementation ``trainer.attn_implementation`` names on ``device``: 'auto' is
    flash_attention_2 on CUDA where the flash-attn package is installed (its varlen kernel runs packed rows
    without a mask), else ``None``: transformers' default, sdpa where the model supports it and eager where
    not (both confine packed samples by a block-diagonal mask). Any other name is taken as it is."""
    if setting != "auto":
        return setting
    import importlib.util

    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


def load_training_model(version_dir: str | Path, *, attn_implementation: str = "auto", packing: bool = False,
                        device: torch.device | str = "cpu") -> torch.nn.Module:
    """The causal LM of a version directory with float32 weights, whatever dtype its files hold (a
    bf16 version 0 gets float32 master weights), on ``device`` (``trainer.device`` resolved by
    ``device.trainer_device``), in eval mode, running ``attn_implementation`` (:func:`attention_for` on
    ``device``). With ``packing`` the attention the model actually got must confine
    attention to each packed sample, or this raises ``ValueError`` (the config refuses such a name before
    anything runs; this also catches a model that overrides it)."""
    import transformers


    # A server's log has no use for a progress bar per load and per published version.
    transformers.utils.logging.disable_progress_bar()

    major = int(transformers.__version__.split(".")[0])
    kwargs = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    attention = attention_for(attn_implementation, device)
    if attention is not None:
        kwargs["attn_implementation"] = attention
    model = transformers.AutoModelForCausalLM.from_pretrained(str(version_dir), **kwargs)
    if packing:
        check_packing_attention(model)
    # Read on CPU, then moved whole: the float32 master weights are made once, on the device they train on.
    return model.float().to(device).eval()


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.Optimizer:
    """The trainer's AdamW over ``model``'s parameters (float32 state, like the weights, made on their
    device at the first step)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=ADAM_BETAS, weight_decay=cfg.weight_decay)


def write_policy_version(model: torch.nn.Module, base_dir: str | Path, out_dir: str | Path,
                         dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model``'s weights in ``dtype`` as an HF directory at ``out_dir`` (atomically, safetensors,
    sharded past ``models.MAX_SHARD_SIZE``), with every non-weight file of ``base_dir`` (tokenizer, chat
    template, generation config) copied unchanged. The tensors written are CPU copies (from a model on CUDA
    too); the model's float32 master weights are not touched."""
    from veriroll.coordinator.models import save_pretrained_checkpoint

    return save_pretrained_checkpoint(getattr(model, "module", model), Path(base_dir), out_dir, dtype=dtype)


def measure_publish(model: torch.nn.Module, tokenizer_dir: str | Path, out_root: str | Path, dtype: torch.dtype | str,
                    key, *, version: int = 1, shard_size: int | None = None) -> dict:
    """Time what the trainer and publisher do for one new version of ``model``: write the checkpoint in
    ``dtype`` (:func:`write_policy_version`, ``save_s``), then shard, hash, link and sign it into a
    shardcast store (``publish_checkpoint``, ``shard_s``). Everything lands under ``out_root``
    (``checkpoint/`` and ``store/``); ``key`` is the coordinator's PrivateKey or its PEM path.

    Returns ``{publish_s, save_s, shard_s, bytes, files, dtype}``: ``bytes`` is what the manifest ships.
    """
    from veriroll.coordinator.models import DTYPES
    from veriroll.shardcast.publish import publish_checkpoint

    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    out_root = Path(out_root)
    checkpoint = out_root / "checkpoint"
    t0 = time.perf_counter()
    write_policy_version(model, tokenizer_dir, checkpoint, dtype)
    t1 = time.perf_counter()
    # link=True as the coordinator's publisher does: installed versions are never modified in place.
    result = publish_checkpoint(checkpoint, out_root / "store", key, version, link=True,
                                **({"shard_size": shard_size} if shard_size else {}))
    t2 = time.perf_counter()
    return {"publish_s": t2 - t0, "save_s": t1 - t0, "shard_s": t2 - t1, "bytes": int(result.total_bytes),
            "files": len(result.manifest.files), "dtype": str(dtype).removeprefix("torch.")}
