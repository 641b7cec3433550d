"""Deterministic tiny Qwen3 / Qwen3-MoE checkpoints in Hugging Face format.

Tests, demos and CI need real checkpoints that every stage (Megatron-Bridge,
vLLM, the refit) can load, without any download. :func:`tiny_model_path` builds
them on first use from a fixed :class:`TinyModelSpec` and a fixed seed and keeps
them in a cache folder:

* ``cache_dir`` when given, else ``$MEGATRON_FP8_CACHE/models`` when that variable
  is set, else ``~/.cache/megatron-fp8/models``;
* inside it, one folder ``<name>-<spec hash>``; the hash covers the spec, the
  tokenizer and the torch / transformers versions, so a change to any of them
  builds a fresh folder instead of reusing a stale one.

The folder is written into a temporary sibling and renamed into place, which is
atomic on one filesystem: parallel first uses (pytest-xdist, several ranks) each
build a copy, one rename wins, the others discard theirs. A folder that exists
under the final name is therefore always complete.

Every weight matrix has both dimensions a multiple of 128 so the 128x128
blockwise FP8 format applies without edge blocks (hidden 256, q_proj 256x256,
k/v_proj 128x256, MLP 512, MoE experts 128).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_fp8.errors import ConfigError, UsageError
from megatron_fp8.files import CACHE_ENV_VAR, cache_root, disk_guard, ensure_dir
from megatron_fp8.models.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_SIZE,
    build_char_tokenizer,
    save_tokenizer,
    special_token_ids,
)
from megatron_fp8.vocab import DEFAULT_BLOCK

logger = logging.getLogger(__name__)


FORMAT_VERSION = 1
"""Bumped whenever the on-disk layout written by this module changes."""

_BUILD_LOCK = threading.RLock()
"""Serialises builds inside one process: weight init draws from torch's global RNG."""

SPEC_FILE = "megatron_fp8_tiny_spec.json"
"""Provenance file written next to the checkpoint (spec, hash inputs)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Dimensions and seed of one tiny checkpoint.

    Attributes:
        name: registry name, also the cache folder prefix.
        architecture: Hugging Face class name: ``"Qwen3ForCausalLM"``, ``"Qwen3MoeForCausalLM"`` or
            ``"LlamaForCausalLM"`` (no q/k norms; for the Llama mappings of Megatron-Bridge and vLLM).
        hidden_size: model width (elements).
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        head_dim: elements per head.
        intermediate_size: dense MLP width (also written for MoE configs).
        vocab_size: embedding rows; a multiple of 128 above the tokenizer size.
        max_position_embeddings: longest sequence in tokens.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        initializer_range: std of the normal init of every linear / embedding weight.
        seed: ``torch.manual_seed`` value used to draw the weights.
        num_experts: routed experts per MoE layer (0 for dense).
        num_experts_per_tok: experts chosen per token (top-k).
        moe_intermediate_size: width of each expert MLP.
    """

    name: str
    architecture: str
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 384
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.04
    seed: int = 1234
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        """Whether the checkpoint has routed experts."""
        return self.num_experts > 0

    def hf_config_kwargs(self) -> dict[str, object]:
        """Keyword arguments for the ``transformers`` config class of :attr:`architecture`."""
        ids = special_token_ids()
        kwargs: dict[str, object] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": False,
            "attention_bias": False,
            "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"],
            "bos_token_id": None,
        }
        if self.is_moe:
            kwargs.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=False,
            )
        return kwargs


def _check_spec(spec: TinyModelSpec) -> None:
    dims = {
        "hidden_size": spec.hidden_size,
        "q_proj out (heads x head_dim)": spec.num_attention_heads * spec.head_dim,
        "k/v_proj out (kv heads x head_dim)": spec.num_key_value_heads * spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
    }
    if spec.is_moe:
        dims["moe_intermediate_size"] = spec.moe_intermediate_size
    bad = {k: v for k, v in dims.items() if v % DEFAULT_BLOCK}
    if bad:
        raise ConfigError(
            f"tiny model {spec.name!r}: dimensions {bad} are not multiples of {DEFAULT_BLOCK}; fix the spec"
        )
    if spec.vocab_size < TOKENIZER_SIZE:
        raise ConfigError(
            f"tiny model {spec.name!r}: vocab_size {spec.vocab_size} is below the tokenizer size {TOKENIZER_SIZE}"
        )


TINY_MODELS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(name="tiny", architecture="Qwen3ForCausalLM"),
    "tiny-llama": TinyModelSpec(name="tiny-llama", architecture="LlamaForCausalLM"),
    "tiny-moe": TinyModelSpec(
        name="tiny-moe",
        architecture="Qwen3MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    ),
}
"""Registry of the embedded tiny checkpoints, by name."""

MODEL_ALIASES: dict[str, str] = {"dense": "tiny", "moe": "tiny-moe"}
"""Alternative names accepted by :func:`tiny_model_path` and :func:`resolve_model`."""


def _valid_names() -> str:
    return ", ".join(sorted([*TINY_MODELS, *MODEL_ALIASES]))


def get_spec(kind: str) -> TinyModelSpec:
    """Look up a tiny model spec by name or alias.

    Args:
        kind: ``"tiny"``, ``"tiny-moe"``, ``"dense"`` or ``"moe"``.

    Raises:
        ConfigError: for an unknown name; the message lists the valid names.
    """
    name = MODEL_ALIASES.get(kind, kind)
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown tiny model {kind!r}; valid names: {_valid_names()}") from None


def default_cache_dir() -> Path:
    """Folder holding the generated checkpoints (see the module docstring)."""
    return cache_root() / "models"


def _hash_inputs(spec: TinyModelSpec) -> dict[str, object]:
    import transformers  # lazy: transformers is optional (only needed to build a checkpoint)

    return {
        "format_version": FORMAT_VERSION,
        "spec": dataclasses.asdict(spec),
        "tokenizer_sha256": hashlib.sha256(build_char_tokenizer().to_str().encode()).hexdigest(),
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
    }


def spec_hash(spec: TinyModelSpec) -> str:
    """Short hex digest (12 characters) of everything that determines the checkpoint bytes."""
    blob = json.dumps(_hash_inputs(spec), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _build_hf_model(spec: TinyModelSpec) -> torch.nn.Module:
    from transformers import (  # lazy: transformers is optional (only needed to build a checkpoint)
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
        "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
        "Qwen3MoeForCausalLM": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    try:
        config_cls, model_cls = classes[spec.architecture]
    except KeyError:
        raise ConfigError(
            f"tiny model {spec.name!r}: unknown architecture {spec.architecture!r}; valid: {', '.join(classes)}"
        ) from None
    config = config_cls(**spec.hf_config_kwargs())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_cls(config)
    return model.to(torch.bfloat16).eval()


def _write_checkpoint(spec: TinyModelSpec, target: Path) -> None:
    from transformers import GenerationConfig  # lazy: transformers is optional

    model = _build_hf_model(spec)
    ids = special_token_ids()
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["eos"], ids["im_end"]], pad_token_id=ids["pad"], bos_token_id=None
    )
    needed = sum(p.numel() * p.element_size() for p in model.parameters())
    kept = f"the cache's other models; the partial folder {target.name} is removed"
    fix = f"free space there, or set {CACHE_ENV_VAR} to a folder on a larger filesystem, then run the command again"
    with disk_guard(target.parent / f"{spec.name}-{spec_hash(spec)}", needed=needed, kept=kept, fix=fix):
        model.save_pretrained(str(target), safe_serialization=True)
        save_tokenizer(target, model_max_length=spec.max_position_embeddings)
        provenance = {**_hash_inputs(spec), "hash": spec_hash(spec), "eos_token": EOS_TOKEN}
        (target / SPEC_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")


def tiny_model_path(kind: str = "dense", *, cache_dir: Path | None = None) -> Path:
    """Path of a tiny Hugging Face checkpoint, generating it on first use.

    The folder holds ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (bfloat16), ``tokenizer.json``, ``tokenizer_config.json``
    and ``special_tokens_map.json``. Generating twice (in different cache folders)
    yields byte-identical ``model.safetensors``.

    Args:
        kind: ``"tiny"`` / ``"dense"`` (Qwen3) or ``"tiny-moe"`` / ``"moe"`` (Qwen3-MoE).
        cache_dir: folder holding the ``<name>-<hash>`` checkpoint folders; defaults to
            :func:`default_cache_dir`.

    Returns:
        Absolute path of the checkpoint folder.

    Raises:
        ConfigError: unknown ``kind`` (the message lists the valid names).
    """
    spec = get_spec(kind)
    _check_spec(spec)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = (root / f"{spec.name}-{spec_hash(spec)}").resolve()
    if (final / "model.safetensors").is_file():
        return final
    ensure_dir(
        root, what="the tiny-model cache", root_from_env=cache_dir is None and bool(os.environ.get(CACHE_ENV_VAR))
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=root))
    try:
        logger.info("generating tiny model %r into %s", spec.name, final)
        with _BUILD_LOCK:
            _write_checkpoint(spec, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
            logger.debug("another process finished %s first; using its copy", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


HF_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""A Hugging Face repository id (``owner/name``), as opposed to a local path."""


def _stage_hint(repo_id: str) -> str:
    """How to stage a Hugging Face model by hand (for machines without network access)."""
    return (
        f"stage the weights where the network is reachable: `huggingface-cli download {repo_id} --local-dir DIR` "
        "(copy DIR here if needed), then pass DIR (`model.name_or_path=DIR`, or `--model DIR`)"
    )


def _download(repo_id: str, *, local_files_only: bool) -> Path:
    """``repo_id`` through ``huggingface_hub.snapshot_download`` into the standard Hugging Face cache.

    Raises:
        ConfigError: ``huggingface_hub`` missing, no network (or ``HF_HUB_OFFLINE=1``) and no cached copy,
            an unknown or gated repository; each message says how to stage the weights.
    """
    try:
        # lazy: huggingface_hub is optional (it comes with transformers); only Hugging Face ids need it
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise ConfigError(
            f"model {repo_id!r} looks like a Hugging Face id, but huggingface_hub is not installed; "
            + _stage_hint(repo_id)
        ) from None
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]
    _hub_offline()  # a value huggingface_hub would read as "online" without a word is refused here
    try:
        if not local_files_only:
            logger.info("resolving Hugging Face model %s (downloads into the Hugging Face cache once)", repo_id)
        folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=local_files_only)
    except GatedRepoError:
        raise ConfigError(
            f"Hugging Face model {repo_id!r} is gated: accept its license on huggingface.co and log in "
            f"(`huggingface-cli login`), or {_stage_hint(repo_id)}"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"Hugging Face model {repo_id!r} was not found on the Hub (check the spelling, or log in for a "
            f"private repository), and it is not a local folder; {_stage_hint(repo_id)}"
        ) from None
    except LocalEntryNotFoundError:
        where = "offline mode (HF_HUB_OFFLINE=1)" if _hub_offline() else "the Hugging Face Hub is unreachable"
        raise ConfigError(
            f"model {repo_id!r} is neither a tiny model name ({_valid_names()}) nor a local folder with "
            f"config.json, and it is not in the Hugging Face cache ({where}); {_stage_hint(repo_id)}"
        ) from None
    except OSError as exc:  # network errors that the hub client does not wrap
        raise ConfigError(
            f"downloading Hugging Face model {repo_id!r} failed ({type(exc).__name__}: {exc}); {_stage_hint(repo_id)}"
        ) from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ConfigError(f"Hugging Face model {repo_id!r} ({path}) has no config.json; is it a model repository?")
    _check_checkpoint_folder(path)
    return path.resolve()


HUB_OFFLINE_VALUES = {"1": True, "true": True, "yes": True, "on": True, "": False, "0": False, "false": False,
                      "no": False, "off": False}  # fmt: skip
"""``HF_HUB_OFFLINE`` values huggingface_hub understands (any other it reads as online, silently)."""


def _hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks the Hugging Face client not to touch the network.

    Raises:
        UsageError: a value that is neither on nor off (huggingface_hub would go online without a word).
    """
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    if value not in HUB_OFFLINE_VALUES:
        raise UsageError(
            f"HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']!r} is neither on nor off; set it to 1 (offline: only the "
            "Hugging Face cache is read) or 0 (may download), or unset it"
        )
    return HUB_OFFLINE_VALUES[value]


def resolve_model(name_or_path: str | Path, *, cache_dir: Path | None = None, download: bool = True) -> Path:
    """Turn a model argument into a checkpoint folder.

    Args:
        name_or_path: a tiny model name (``"tiny"``, ``"tiny-moe"``, or the aliases ``"dense"`` / ``"moe"``),
            an existing Hugging Face folder with a ``config.json``, or a Hugging Face id (``Qwen/Qwen3-8B``),
            resolved through ``huggingface_hub.snapshot_download`` into the standard Hugging Face cache.
        cache_dir: passed to :func:`tiny_model_path` for tiny names.
        download: for a Hugging Face id, whether the network may be used; ``False`` takes only a copy
            already in the Hugging Face cache.

    Returns:
        Absolute path of the checkpoint folder.

    Raises:
        ConfigError: neither a known name, nor a folder with ``config.json``, nor a Hugging Face id that can be
            fetched (offline: the message says how to stage the weights: ``huggingface-cli download ...
            --local-dir DIR``, then ``model.name_or_path=DIR``).
    """
    key = str(name_or_path)
    if key in TINY_MODELS or key in MODEL_ALIASES:
        return tiny_model_path(key, cache_dir=cache_dir)
    path = Path(key).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        _check_checkpoint_folder(path)
        return path.resolve()
    if path.is_dir():
        raise ConfigError(f"model folder {path} has no config.json; point at a Hugging Face checkpoint folder")
    if HF_ID_PATTERN.match(key) and not key.startswith((".", "~")):
        return _download(key, local_files_only=not download or _hub_offline())
    if path.exists():
        raise ConfigError(f"model {key!r} is a file; point at the checkpoint folder holding config.json")
    if "/" in key or os.sep in key or key.startswith((".", "~")):  # a path, not a name: nothing to download
        raise ConfigError(
            f"model path {key!r} does not exist; pass an existing checkpoint folder holding config.json and "
            f"*.safetensors, a tiny model name ({_valid_names()}) or a Hugging Face id (owner/name)"
        )
    raise ConfigError(
        f"model {key!r} is neither a tiny model name ({_valid_names()}), nor an existing Hugging Face folder "
        f"containing config.json, nor a Hugging Face id (owner/name); {_stage_hint(key)}"
    )


def _check_checkpoint_folder(path: Path) -> None:
    """Refuse a folder whose ``config.json`` is not a JSON object or whose safetensors headers are unreadable."""
    cfg = path / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{cfg} is not valid JSON ({exc}); re-download or fix the checkpoint's config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"{cfg} is not a Hugging Face model config (no 'model_type'); point at a checkpoint folder")
    for shard in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(shard), framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
            raise ConfigError(
                f"{shard} cannot be read ({type(exc).__name__}: {exc}); the file is truncated or damaged: "
                "re-download the checkpoint"
            ) from None
