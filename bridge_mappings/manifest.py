"""The FP8 manifest: which HF parameters vLLM holds in FP8, asked of vLLM once.

Never derived from name rules. Two sources, both vLLM's own answer:

* ``vllm-param-dtype``: a live FP8 engine (GPU) — a linear layer whose weight is
  float8_e4m3fn, fused modules mapped back to their HF shards through the model's
  ``packed_modules_mapping``, MoE experts whose ``w13``/``w2`` are FP8;
* ``vllm-quant-method``: where vLLM cannot build an FP8 model (CPU: its FP8
  kernels need CUDA or AMX), a BF16-built engine's layers are handed to vLLM's
  ``Fp8Config.get_quant_method`` under the same ``ignored_layers`` and packed
  mapping — the decision vLLM takes when it builds the FP8 engine.

The answer is stored as JSON with a :class:`Fingerprint` (model config hash, vLLM
version, quantization config, BF16 first/last layers) in a file whose name carries
the fingerprint's digest (:class:`ManifestStore`): setups of one model coexist and
each is reused. A stored file whose content hash or fingerprint is not its own
(edited, truncated) is refused with a warning and asked again, never silently reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_fp8.errors import ManifestError
from megatron_fp8.files import CACHE_ENV_VAR, cache_root, ensure_dir, write_atomically
from megatron_fp8.rollout.vllm import adapter as vllm_adapter

if TYPE_CHECKING:  # vLLM's engine, for annotations only (named by the vLLM adapter, vLLM's one room)
    from megatron_fp8.rollout.vllm.adapter import LLM

logger = logging.getLogger(__name__)

MANIFEST_SCHEMA = 2
_LAYER_RE = re.compile(r"^(?P<prefix>.*\blayers)\.(?P<idx>\d+)\.(?P<rest>.+)$")


def _canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load_hf_config(model_path: str | Path) -> dict:
    """Read ``config.json`` of an HF checkpoint folder."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ManifestError(f"{model_path}: no config.json; pass an HF checkpoint folder (or --model tiny)")
    return json.loads(path.read_text())


def model_config_hash(config: dict) -> str:
    """sha256 of the model config, ignoring fields that do not change the weights' layout."""
    ignore = {"_name_or_path", "transformers_version", "quantization_config", "architectures_version"}
    return _sha(_canonical({k: v for k, v in config.items() if k not in ignore}))


def checkpoint_tensors(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor in an HF safetensors checkpoint (headers only)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ManifestError(f"{model_path}: no *.safetensors files")
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                out[name] = tuple(handle.get_slice(name).get_shape())
    return out


def build_quantization_config(
    model_path: str | Path,
    *,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    keep_router_bf16: bool = True,
    weight_block_size: Sequence[int] | None = (128, 128),
    extra_ignored_layers: Sequence[str] = (),
    ignored_layer_kws: Sequence[str] = (),
) -> dict:
    """The HF ``quantization_config`` handed to vLLM (``hf_overrides``).

    ``ignored_layers`` lists the *modules* vLLM must keep in BF16: every 2-D
    weight's module in the first/last ``N`` decoder layers (the routed-experts
    module once per layer), and, for MoE layers, the router (the 2-D weight whose
    output size is ``num_experts``) when ``keep_router_bf16``, and every 2-D weight's
    module whose name contains one of ``ignored_layer_kws`` (NeMo-RL's
    ``vllm_cfg.quantization_ignored_layer_kws``; routed experts as their experts module).
    vLLM then decides per layer; the manifest records its decision.
    """
    config = load_hf_config(model_path)
    num_layers = int(config.get("num_hidden_layers", 0))
    if num_first_layers_in_bf16 < 0 or num_last_layers_in_bf16 < 0:
        raise ManifestError("num_first_layers_in_bf16 / num_last_layers_in_bf16 must be >= 0")
    if num_first_layers_in_bf16 + num_last_layers_in_bf16 > num_layers:
        raise ManifestError(
            f"num_first_layers_in_bf16 ({num_first_layers_in_bf16}) + num_last_layers_in_bf16 "
            f"({num_last_layers_in_bf16}) exceeds the model's {num_layers} layers"
        )
    bf16_layers = set(range(num_first_layers_in_bf16)) | set(range(num_layers - num_last_layers_in_bf16, num_layers))
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    ignored: set[str] = set(extra_ignored_layers)
    for name, shape in checkpoint_tensors(model_path).items():
        if (
            len(shape) == 2
            and name.endswith(".weight")
            and any(kw in name[: -len(".weight")] for kw in ignored_layer_kws)
        ):
            expert_module = re.match(r"^(.*\.experts)\.\d+\.", name)
            ignored.add(expert_module.group(1) if expert_module else name[: -len(".weight")])
        m = _LAYER_RE.match(name)
        if not m or len(shape) != 2 or not name.endswith(".weight"):
            continue
        idx, module = int(m["idx"]), name[: -len(".weight")]
        expert = re.match(r"^(.*\.experts)\.\d+\.", module)
        if idx in bf16_layers:
            ignored.add(expert.group(1) if expert else module)
        elif keep_router_bf16 and num_experts and not expert and shape[0] == int(num_experts):
            ignored.add(module)
    qcfg: dict[str, object] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if weight_block_size is not None:
        qcfg["weight_block_size"] = [int(b) for b in weight_block_size]
    qcfg["ignored_layers"] = sorted(ignored)
    return qcfg


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a manifest depends on; a stored manifest is reused only when all match."""

    model_config_sha256: str
    vllm_version: str
    quantization_config: str  # canonical JSON
    num_first_layers_in_bf16: int
    num_last_layers_in_bf16: int

    @property
    def digest(self) -> str:
        return _sha(_canonical(dataclasses.asdict(self)))[:16]

    def differences(self, other: Fingerprint) -> list[str]:
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        return [f"{k}: stored {a[k]!r} != now {b[k]!r}" for k in a if a[k] != b[k]]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """vLLM's answer: the HF weights it holds in FP8 and everything else.

    Attributes:
        source: how vLLM was asked, e.g. ``"vllm-quant-method 0.32.0"``.
        fingerprint: what the answer depends on.
        fp8_params: HF weight names vLLM holds in float8_e4m3fn (sorted).
        bf16_params: every other tensor of the checkpoint (sorted).
        fp8_capable_bf16: linear/expert weights vLLM *could* hold in FP8 but keeps
            in BF16 under this config (ignored layers): deliberately BF16.
        quantization_config: the dict vLLM was given.
    """

    source: str
    fingerprint: Fingerprint
    fp8_params: tuple[str, ...]
    bf16_params: tuple[str, ...]
    fp8_capable_bf16: tuple[str, ...]
    quantization_config: dict

    def to_json(self) -> dict:
        return {
            "schema": MANIFEST_SCHEMA,
            "source": self.source,
            "fingerprint": {**dataclasses.asdict(self.fingerprint), "digest": self.fingerprint.digest},
            "fp8_params": list(self.fp8_params),
            "bf16_params": list(self.bf16_params),
            "fp8_capable_bf16": list(self.fp8_capable_bf16),
            "quantization_config": self.quantization_config,
        }

    @classmethod
    def from_json(cls, data: dict, *, where: str = "manifest") -> Manifest:
        try:
            if data.get("schema") != MANIFEST_SCHEMA:
                raise ManifestError(f"{where}: schema {data.get('schema')!r}, expected {MANIFEST_SCHEMA}; delete it")
            fp = {k: v for k, v in data["fingerprint"].items() if k != "digest"}
            return cls(
                source=data["source"],
                fingerprint=Fingerprint(**fp),
                fp8_params=tuple(data["fp8_params"]),
                bf16_params=tuple(data["bf16_params"]),
                fp8_capable_bf16=tuple(data["fp8_capable_bf16"]),
                quantization_config=data["quantization_config"],
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{where}: malformed manifest ({exc}); delete it and ask vLLM again") from exc

    @property
    def fp8_set(self) -> frozenset[str]:
        return frozenset(self.fp8_params)


def make_fingerprint(
    model_path: str | Path, quantization_config: dict, *, num_first_layers_in_bf16: int, num_last_layers_in_bf16: int
) -> Fingerprint:
    return Fingerprint(
        model_config_sha256=model_config_hash(load_hf_config(model_path)),
        vllm_version=vllm_adapter.vllm_version() or "not-installed",
        quantization_config=_canonical(quantization_config),
        num_first_layers_in_bf16=int(num_first_layers_in_bf16),
        num_last_layers_in_bf16=int(num_last_layers_in_bf16),
    )


def manifest_from_decisions(
    decisions: Sequence[dict],
    *,
    source: str,
    fingerprint: Fingerprint,
    checkpoint_names: Sequence[str],
    quantization_config: dict,
) -> Manifest:
    """Assemble a :class:`Manifest` from vLLM's per-module decisions (worker output)."""
    fp8, capable_bf16 = set(), set()
    for d in decisions:
        (fp8 if d["is_fp8"] else capable_bf16).update(d["hf_weights"])
    names = set(checkpoint_names)
    unknown = sorted((fp8 | capable_bf16) - names)
    if unknown:
        raise ManifestError(
            f"vLLM reports weights the checkpoint does not have: {unknown[:5]} (of {len(unknown)}); "
            "the HF-name mapping of this model is not understood"
        )
    return Manifest(
        source=source,
        fingerprint=fingerprint,
        fp8_params=tuple(sorted(fp8)),
        bf16_params=tuple(sorted(names - fp8)),
        fp8_capable_bf16=tuple(sorted(capable_bf16)),
        quantization_config=quantization_config,
    )


def ask_vllm(
    model_path: str | Path,
    quantization_config: dict,
    *,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    llm: LLM | None = None,
) -> Manifest:
    """Ask vLLM which parameters it holds in FP8 (builds an engine unless ``llm`` is given).

    With CUDA, an FP8 engine is built and its parameter dtypes are read
    (``vllm-param-dtype``); without, a BF16 engine is built and vLLM's FP8
    quantization config is asked per layer (``vllm-quant-method``). A given
    ``llm`` must carry :class:`~megatron_fp8.rollout.vllm.worker_extension.FP8RefitWorkerExtension`.
    """
    fingerprint = make_fingerprint(
        model_path,
        quantization_config,
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
    )
    live = torch.cuda.is_available() if llm is None else _is_fp8_engine(llm)
    if llm is None:
        llm = vllm_adapter.build_llm(
            str(model_path), quantization_config=quantization_config if live else None, skip_tokenizer_init=True
        )
    if live:
        decisions = llm.collective_rpc("mfp8_param_dtype_decisions")[0]
        source = f"vllm-param-dtype {vllm_adapter.vllm_version()}"
    else:
        decisions = llm.collective_rpc("mfp8_quant_decisions", args=(quantization_config,))[0]
        source = f"vllm-quant-method {vllm_adapter.vllm_version()}"
    manifest = manifest_from_decisions(
        decisions,
        source=source,
        fingerprint=fingerprint,
        checkpoint_names=list(checkpoint_tensors(model_path)),
        quantization_config=quantization_config,
    )
    logger.info(
        "vLLM holds %d of %d checkpoint tensors in FP8 (%s)",
        len(manifest.fp8_params),
        len(manifest.fp8_params) + len(manifest.bf16_params),
        source,
    )
    return manifest


def _is_fp8_engine(llm: LLM) -> bool:
    decisions = llm.collective_rpc("mfp8_param_dtype_decisions")[0]
    return any(d["is_fp8"] for d in decisions)


def default_store_dir() -> Path:
    return cache_root() / "manifests"


def content_digest(data: dict) -> str:
    """sha256 of a stored manifest's JSON without its ``content_sha256`` field (detects edits and truncation)."""
    return _sha(_canonical({k: v for k, v in data.items() if k != "content_sha256"}))


@dataclasses.dataclass(frozen=True)
class StoredManifest:
    """A manifest and where it came from this time."""

    manifest: Manifest
    path: Path
    reused: bool


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing), held for the ``with`` block."""
    ensure_dir(path.parent, what="the manifest cache", root_from_env=bool(os.environ.get(CACHE_ENV_VAR)))
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class ManifestStore:
    """JSON files of manifests keyed by setup: one file per (model, quantization config, BF16 layers, vLLM).

    The file name carries the setup's :attr:`Fingerprint.digest`, so setups of one model coexist and each
    is reused. A stored file is trusted only when its fingerprint is the one asked for and its content
    hash matches (an edited or truncated file is refused with a warning and asked again). Writes are
    atomic (temporary file + rename) and asks are serialised per setup by a file lock, so processes asking
    at once on an empty cache ask vLLM once and never see a partial file.
    """

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_store_dir()

    def _stem(self, model_path: str | Path) -> str:
        return Path(model_path).resolve().name

    def path_for(self, model_path: str | Path, fingerprint: Fingerprint | None = None) -> Path:
        """The file of ``model_path`` under ``fingerprint``'s setup.

        Without a fingerprint: the most recently stored manifest of the model (the setup-less name when none).
        """
        stem = self._stem(model_path)
        if fingerprint is not None:
            return self.root / f"{stem}-{fingerprint.digest}.json"
        stored = sorted(self.root.glob(f"{glob.escape(stem)}-*.json"), key=lambda p: p.stat().st_mtime)
        return stored[-1] if stored else self.root / f"{stem}.json"

    def load(self, model_path: str | Path, expected: Fingerprint) -> Manifest | None:
        """The stored manifest of this setup, or ``None`` (none stored, or a stored one is refused).

        A refused file (not JSON, malformed, another schema, content hash or fingerprint not its own) is
        logged as a warning; the caller asks vLLM again and the new answer replaces it.
        """
        path = self.path_for(model_path, expected)
        if not path.is_file():
            return None
        try:
            return self._read(path, expected)
        except ManifestError as exc:
            logger.warning("%s -- refusing it and asking vLLM again", exc)
            return None

    def _read(self, path: Path, expected: Fingerprint) -> Manifest:
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"stored FP8 manifest {path} is not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ManifestError(f"stored FP8 manifest {path} is not a JSON object")
        if data.get("content_sha256") != content_digest(data):
            raise ManifestError(f"stored FP8 manifest {path} does not match its content hash (edited or truncated)")
        manifest = Manifest.from_json(data, where=str(path))
        diffs = manifest.fingerprint.differences(expected)
        if diffs:
            raise ManifestError(
                f"stored FP8 manifest {path} does not carry the fingerprint of its name: " + "; ".join(diffs)
            )
        return manifest

    def save(self, model_path: str | Path, manifest: Manifest) -> Path:
        """Write ``manifest`` atomically to its setup's file (a reader sees the old file or the new one)."""
        path = self.path_for(model_path, manifest.fingerprint)
        ensure_dir(path.parent, what="the manifest cache", root_from_env=bool(os.environ.get(CACHE_ENV_VAR)))
        data = manifest.to_json()
        data["content_sha256"] = content_digest(data)
        write_atomically(path, json.dumps(data, indent=1))
        return path

    def get_or_ask(
        self,
        model_path: str | Path,
        quantization_config: dict,
        *,
        num_first_layers_in_bf16: int = 0,
        num_last_layers_in_bf16: int = 0,
        refresh: bool = False,
        llm: LLM | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> StoredManifest:
        """Reuse the stored manifest when its fingerprint matches, else ask vLLM once.

        With a ``torch.distributed`` ``group``, only its first rank reads/asks and
        the result is broadcast to the others.
        """
        distributed = group is not None and dist.is_initialized()
        rank = dist.get_rank(group) if distributed else 0
        payload: list[StoredManifest | None] = [None]
        if rank == 0:
            payload[0] = self._get_or_ask_local(
                model_path,
                quantization_config,
                num_first_layers_in_bf16=num_first_layers_in_bf16,
                num_last_layers_in_bf16=num_last_layers_in_bf16,
                refresh=refresh,
                llm=llm,
            )
        if distributed:
            src = dist.get_global_rank(group, 0)
            dist.broadcast_object_list(payload, src=src, group=group)
        stored = payload[0]
        if stored is None:
            raise ManifestError(f"rank 0 of the group sent no FP8 manifest for {model_path}")
        return stored

    def _get_or_ask_local(
        self,
        model_path: str | Path,
        quantization_config: dict,
        *,
        num_first_layers_in_bf16: int,
        num_last_layers_in_bf16: int,
        refresh: bool,
        llm: LLM | None,
    ) -> StoredManifest:
        expected = make_fingerprint(
            model_path,
            quantization_config,
            num_first_layers_in_bf16=num_first_layers_in_bf16,
            num_last_layers_in_bf16=num_last_layers_in_bf16,
        )
        path = self.path_for(model_path, expected)
        with _file_lock(path.with_name(f".{path.name}.lock")):  # one ask per setup, whoever comes first
            if not refresh:
                stored = self.load(model_path, expected)
                if stored is not None:
                    logger.info("reusing stored FP8 manifest %s (fingerprint %s)", path, expected.digest)
                    return StoredManifest(stored, path, reused=True)
            manifest = ask_vllm(
                model_path,
                quantization_config,
                num_first_layers_in_bf16=num_first_layers_in_bf16,
                num_last_layers_in_bf16=num_last_layers_in_bf16,
                llm=llm,
            )
            return StoredManifest(manifest, self.save(model_path, manifest), reused=False)
