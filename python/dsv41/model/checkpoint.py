"""Checkpoints: `config.json` + safetensors shards + `model.safetensors.index.json`.

Layout (Hugging Face style): config.json holds `ModelConfig.to_hf_dict()` plus a `dsv41`
section (format version, model options); weights are float32 safetensors shards named
model-00001-of-0000N.safetensors, each at most `max_shard_bytes` (a tensor larger than
that gets a shard of its own), and the index maps every tensor name to its shard. Loading
also accepts a single `model.safetensors` without an index.

Loading also reads a directory written by transformers' DeepseekV4ForCausalLM.
save_pretrained and DeepSeek's original naming with FP8 / FP4 weights (dequantized to
float32 on load; `weights.py` gives the layouts). Draft-layer (`mtp.*`) tensors are
ignored. Loading checks everything before it allocates the model: each shard's header
against its bytes (safetensors_file.py: a truncated or damaged shard is named with what is
wrong), the names, shapes and dtypes of every tensor against the model the config builds,
and the values of every integer (index-like) tensor by the module that owns it
(`check_loaded`: a hash table's expert ids in range), failing with an error naming the
file or tensor.

`weights_digest.json` records the weights' content digest (model/weights_id.py): written by
save_pretrained and `dsv41 digest DIR`, re-checked cheaply by load_pretrained, which sets
`model.weights_id` from it (the prefix cache's key for this model's weights).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ConfigError, ModelConfig
from ..config.json_io import read_config_file
from .production import place_quantized, take_quantized
from .safetensors_file import ShardError, read_header
from .weights import (
    WeightError,
    dequantize_all,
    from_transformers,
    is_transformers_naming,
    read_quantization,
)
from .weights_id import check_weights_id, record_weights_digest, recorded_weights_digest

__all__ = ["CheckpointError", "save_pretrained", "load_pretrained", "shard_files", "digest_checkpoint",
           "CONFIG_NAME", "INDEX_NAME", "INDEX_MAX_BYTES", "MODEL_OPTIONS"]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
# The index is one ~100-byte line per tensor: 64 MiB holds over half a million tensors, far
# more than any checkpoint has, and is read whole at load.
INDEX_MAX_BYTES = 64 << 20
# What save_pretrained records under the config's "dsv41" key, by name and JSON type.
MODEL_OPTIONS = {"indexer_rotation": bool}
SINGLE_NAME = "model.safetensors"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config describes."""


def _names(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def save_pretrained(model, directory: str | Path, *, max_shard_bytes: int = 2 << 30) -> None:
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if model.embed.weight.is_meta:
        raise RuntimeError("save_pretrained: the weights are on the meta device")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    options = {k: v for k, v in model.options.items() if k != "kv_dtype"}  # a load-time choice
    cfg["dsv41"] = {"format_version": FORMAT_VERSION, "model_options": options,
                    "torch_dtype": "float32"}
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype)
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    n = len(shards)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    record_weights_digest(out, weight_map.values())


def _json_kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _stored_options(raw: dict, where: Path) -> dict:
    """The model options save_pretrained recorded under the config's "dsv41" key (absent in
    a config from elsewhere): {"model_options": {"indexer_rotation": bool}}. kv_dtype, a
    load-time choice, is ignored. CheckpointError naming the key for anything else."""
    section = raw.get("dsv41", {})
    if not isinstance(section, dict):
        raise CheckpointError(f'{where}: the "dsv41" key must hold a JSON object, got {_json_kind(section)}')
    options = section.get("model_options", {})
    if not isinstance(options, dict):
        raise CheckpointError(f'{where}: "dsv41"."model_options" must be a JSON object, '
                              f"got {_json_kind(options)}")
    options = {k: v for k, v in options.items() if k != "kv_dtype"}
    unknown = sorted(set(options) - set(MODEL_OPTIONS))
    if unknown:
        raise CheckpointError(f'{where}: "dsv41"."model_options" holds unknown options {_names(unknown, 4)} '
                              f"(known: {', '.join(MODEL_OPTIONS)})")
    for name, kind in MODEL_OPTIONS.items():
        if name in options and not isinstance(options[name], kind):
            raise CheckpointError(f'{where}: "dsv41"."model_options"."{name}" must be {kind.__name__}, '
                                  f"got {_json_kind(options[name])}")
    return options


def _weight_map(directory: Path) -> dict[str, str]:
    if (directory / INDEX_NAME).exists():
        try:   # bounded and checked like a config: a FIFO or /dev/zero is refused, never read
            index = read_config_file(directory / INDEX_NAME, max_bytes=INDEX_MAX_BYTES)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        except OSError as e:
            raise CheckpointError(f"{directory / INDEX_NAME}: {e.strerror or e}") from None
        if not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{directory / INDEX_NAME}: no 'weight_map' dict")
        bad = [k for k, v in index["weight_map"].items() if not isinstance(v, str)]
        if bad:
            raise CheckpointError(f"{directory / INDEX_NAME}: weight_map gives no file name "
                                  f"for {_names(bad, 3)}")
        return dict(index["weight_map"])
    if (directory / SINGLE_NAME).exists():
        return {k: SINGLE_NAME for k in _header(directory, SINGLE_NAME).tensors}
    raise CheckpointError(f"{directory}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def _header(directory: Path, fname: str):
    """The shard's checked header (safetensors_file.py): a damaged shard is named with what
    is wrong with it before the safetensors library reads it."""
    try:
        return read_header(directory / fname)
    except ShardError as e:
        raise CheckpointError(f"shard {e}") from None


def _read_shard(directory: Path, fname: str, names: list[str]) -> dict[str, torch.Tensor]:
    present = _header(directory, fname).tensors
    for name in names:
        if name not in present:
            raise CheckpointError(f"{fname}: the index lists tensor {name!r} in this "
                                  f"shard, but it is not there")
    try:
        with safe_open(str(directory / fname), framework="pt") as f:
            return {name: f.get_tensor(name) for name in names}
    except Exception as e:  # safetensors' own error type: name the file with it
        raise CheckpointError(f"shard {directory / fname}: unreadable: "
                              f"{type(e).__name__}: {e}") from None


def _tie_head(tensors: dict[str, torch.Tensor], raw: dict) -> None:
    """With tie_word_embeddings (top level or in text_config) the head is the embedding:
    transformers then saves no head.weight. dsv41 keeps its own copy of it (the same values;
    save_pretrained writes both, untied, which reads back to the same model)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    if not (raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")):
        return
    if "embed.weight" not in tensors:
        return                      # reported as missing with the other tensors
    embed = tensors["embed.weight"]
    head = tensors.setdefault("head.weight", embed)
    if head is not embed and not torch.equal(head.to(embed.dtype), embed):
        raise CheckpointError("tie_word_embeddings is set, but the checkpoint's head.weight "
                              "differs from embed.weight")


def _check_tensor(model, name: str, t: torch.Tensor, want: torch.Tensor) -> None:
    """A checkpoint tensor against the parameter or buffer it fills: shape, dtype kind and,
    for integer (index-like) tensors, the owning module's range rule (`check_loaded`)."""
    if tuple(t.shape) != tuple(want.shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, "
                              f"expected {tuple(want.shape)}")
    if want.is_floating_point():
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, expected a "
                                  f"floating dtype")
        return
    owner, _, attr = name.rpartition(".")
    check = getattr(model.get_submodule(owner), "check_loaded", None)
    reason = (f"dsv41 has no range rule for its integer tensor {attr!r}" if check is None
              else check(attr, t))
    if reason is not None:
        raise CheckpointError(f"tensor {name!r}: {reason}")


def shard_files(directory: str | Path) -> list[str]:
    """The safetensors files that hold a checkpoint's tensors."""
    return sorted(set(_weight_map(Path(directory)).values()))


def digest_checkpoint(directory: str | Path, progress=None) -> str:
    """Computes the weights digest of a checkpoint and records it in its weights_digest.json
    (`dsv41 digest DIR`); progress(bytes_done, bytes_total) is called as it goes."""
    directory = Path(directory)
    if not (directory / CONFIG_NAME).exists():
        raise CheckpointError(f"{directory}: no {CONFIG_NAME} (not a checkpoint directory)")
    files = shard_files(directory)
    for fname in files:
        if not (directory / fname).is_file():
            raise CheckpointError(f"{directory}: shard {fname} is missing")
    return record_weights_digest(directory, files, progress)


def load_pretrained(cls, directory: str | Path, *, device: str | torch.device = "cpu",
                    kv_dtype: str = "stored", weights_id: str | None = None,
                    precision: str = "reference"):
    """The model of a checkpoint directory. weights_id: the operator's identity for these
    weights; by default the recorded digest (None when the checkpoint has none)."""
    weights_id = check_weights_id(weights_id)
    directory = Path(directory)
    if not (directory / CONFIG_NAME).exists():
        raise CheckpointError(f"{directory}: no {CONFIG_NAME}")
    raw = read_config_file(directory / CONFIG_NAME)
    config = ModelConfig.from_dict(raw)
    options = _stored_options(raw, directory / CONFIG_NAME)
    with torch.device("meta"):
        model = cls(config, **options, kv_dtype=kv_dtype, precision=precision)
    expected = dict(model.state_dict())
    weight_map = {k: v for k, v in _weight_map(directory).items() if not k.startswith("mtp.")}
    files: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        files.setdefault(fname, []).append(name)
    for fname, names in files.items():
        if not (directory / fname).exists():
            raise CheckpointError(f"{directory}: shard {fname} (holding {_names(names, 3)}) "
                                  f"is missing")
    tensors: dict[str, torch.Tensor] = {}
    for fname, names in files.items():
        tensors.update(_read_shard(directory, fname, names))
    try:
        if is_transformers_naming(tensors):
            tensors = from_transformers(tensors)
        quant = read_quantization(raw)
        # The production path keeps FP8/FP4 weights as shipped (production.py).
        kept = take_quantized(tensors, quant) if precision != "reference" else {}
        tensors = dequantize_all(tensors, quant)
    except WeightError as exc:
        raise CheckpointError(f"{directory}: {exc}") from None
    _tie_head(tensors, raw)
    missing = set(expected) - set(tensors) - {f"{name}.weight" for name in kept}
    extra = set(tensors) - set(expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_names(missing)}")
        if extra:
            parts.append(f"unexpected tensors: {_names(extra)}")
        raise CheckpointError(f"{directory}: checkpoint does not match config "
                              f"{config.name!r}: " + "; ".join(parts))
    for name, t in tensors.items():   # every check before any memory is allocated
        _check_tensor(model, name, t, expected[name])
    model = model.to_empty(device=device)
    place_quantized(model, kept, device)
    params = model.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t.to(params[name].dtype))
    # The digest covers every shard (draft-layer ones too), as `dsv41 digest` records it.
    model.weights_id = (weights_id if weights_id is not None
                        else recorded_weights_digest(directory, shard_files(directory)))
    return model
