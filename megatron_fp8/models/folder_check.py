"""A model folder checked against its own weights without loading them: ``config.json`` vs the safetensors headers.

A safetensors file starts with an 8-byte little-endian length and a JSON header naming every tensor's dtype and
shape, so the check reads a few KiB per shard whatever the model's size. ``megatron-fp8 config`` and ``grpo`` run
it before anything is built: a ``config.json`` that lacks a dimension, or disagrees with the weights (a wrong file
copied in, a partial download, a hand edit), is refused naming the key, the tensor, its file and both sizes,
instead of failing later inside Megatron-Bridge.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from pathlib import Path

REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""``config.json`` keys every decoder-only model megatron-fp8 builds must give."""

MAPPED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""The Hugging Face architectures megatron-fp8 maps end to end (Megatron-Bridge build and export, the FP8 manifest's
``model.layers.N.self_attn.q_proj``-style names, the refit's fused q/k/v and gate/up rows), each with its
``model_type``: the families of the embedded tiny models (``tiny-llama``, ``tiny``, ``tiny-moe``) and of
:mod:`megatron_fp8.models.dims`. Another architecture (GPT-2, GPT-NeoX, ...) would fail late, inside the bridge or
the manifest; it is refused before anything is built."""

MAX_HEADER_BYTES = 100 << 20
"""A safetensors header larger than this is a damaged file (real headers are KiB to a few MiB)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def header_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's shape and file, from the headers of the folder's ``*.safetensors`` (no tensor data read).

    Raises:
        ValueError: a file too short or with a header that is not safetensors JSON (naming the file).
    """
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with shard.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{shard}: {len(raw)} bytes, not a safetensors file (truncated download?)")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"{shard}: header of {size} bytes, not a safetensors file (damaged?)")
            try:
                header = json.loads(f.read(size))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{shard}: unreadable safetensors header ({exc}); re-download it") from None
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, Mapping):
                shapes[name] = (tuple(int(d) for d in info.get("shape", ())), shard)
    return shapes


def _expected(hf: Mapping[str, object]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (the shape config.json implies, the keys it comes from), for the tensors every layout has."""
    hidden, heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads  # type: ignore[operator]
    out = {
        "model.embed_tokens.weight": ((vocab, hidden), "vocab_size x hidden_size"),
        "model.layers.0.self_attn.q_proj.weight": ((heads * head_dim, hidden), "num_attention_heads x head_dim"),
        "model.layers.0.self_attn.k_proj.weight": ((kv * head_dim, hidden), "num_key_value_heads x head_dim"),
    }
    if hf.get("intermediate_size") and not (hf.get("num_experts") or hf.get("num_local_experts")):
        out["model.layers.0.mlp.gate_proj.weight"] = ((hf["intermediate_size"], hidden), "intermediate_size")
    return out  # type: ignore[return-value]


def architecture_problem(hf: Mapping[str, object], *, cfg_path: Path) -> str | None:
    """Why megatron-fp8 cannot run the model ``config.json`` describes (``None``: a :data:`MAPPED_ARCHITECTURES` one).

    Judged from ``architectures`` when it is there, else from ``model_type``; a file with neither is left to the
    dimension checks.
    """
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    if isinstance(archs, list) and archs:
        if any(a in MAPPED_ARCHITECTURES for a in archs):
            return None
        what = f"architecture {', '.join(map(str, archs))}"
    elif isinstance(model_type, str) and model_type:
        if model_type in MAPPED_ARCHITECTURES.values():
            return None
        what = f"model_type {model_type!r}"
    else:
        return None
    return (
        f"{cfg_path} describes a model of {what}, which megatron-fp8 does not map (its trainer, FP8 manifest and "
        f"refit know {', '.join(MAPPED_ARCHITECTURES)}); choose a model of one of these families, e.g. --model tiny"
    )


def folder_problems(folder: str | Path) -> list[str]:
    """What is wrong with a model folder, judged from ``config.json`` and the safetensors headers (empty: fine).

    Returns:
        One line per problem: a missing key, no weights, an unreadable shard, a shape or layer count that
        disagrees with ``config.json`` (naming the key, the tensor, its file and both values).
    """
    root = Path(folder)
    cfg_path = root / "config.json"
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        return [f"{cfg_path}: cannot read the model's config ({exc})"]
    if not isinstance(hf, dict):
        return [f"{cfg_path} is not a JSON object: not a Hugging Face model config"]
    unmapped = architecture_problem(hf, cfg_path=cfg_path)
    if unmapped is not None:
        return [unmapped]
    hf = hf.get("text_config", hf) if isinstance(hf.get("text_config"), dict) else hf
    missing = [k for k in REQUIRED_KEYS if not isinstance(hf.get(k), int)]
    if missing:
        return [f"{cfg_path} gives no integer {', '.join(missing)}: megatron-fp8 cannot build the model from it"]
    try:
        shapes = header_shapes(root)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    if not shapes:
        return [f"{root} holds no *.safetensors weights: stage the checkpoint's safetensors files next to config.json"]
    problems = []
    for name, (want, keys) in _expected(hf).items():
        if name in shapes and shapes[name][0] != want:
            got, shard = shapes[name]
            problems.append(
                f"{cfg_path} implies {name} of shape {list(want)} ({keys}), but {shard.name} holds {list(got)}: "
                "config.json and the weights disagree (another model's config, a hand edit, a partial download)"
            )
    layers = {int(m.group(1)) for n in shapes if (m := _LAYER.match(n))}
    if layers and max(layers) + 1 != hf["num_hidden_layers"]:
        problems.append(
            f"{cfg_path} says num_hidden_layers={hf['num_hidden_layers']}, but the weights hold layers "
            f"0..{max(layers)} ({len(layers)} layers): config.json and the weights disagree (a partial download?)"
        )
    return problems
