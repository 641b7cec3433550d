"""The FP8 rollout of a GRPO run: vLLM's ``quantization_config`` and vLLM's FP8 manifest for it.

Asked once per run, before the arms; the manifest names exactly the weights the refit sends in
FP8 (+ 128x128 block scales). Nothing here imports vLLM: the manifest is asked in a child process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from bridge_mappings.manifest import Manifest, ManifestStore, build_quantization_config, make_fingerprint
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError, ManifestError
from megatron_fp8.rollout.vllm.adapter import vllm_version

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 900
"""Seconds the child process asking vLLM for the manifest may take."""

_ASK_SCRIPT = (
    "import json, sys\n"
    "from bridge_mappings.manifest import ManifestStore\n"
    "ManifestStore().get_or_ask(sys.argv[1], json.loads(sys.argv[2]), num_first_layers_in_bf16=int(sys.argv[3]),\n"
    "    num_last_layers_in_bf16=int(sys.argv[4]), refresh=sys.argv[5] == '1')\n"
)


def rollout_quantization_config(config: RunConfig, model_path: Path) -> dict:
    """vLLM's FP8 ``quantization_config`` for this run (explicit one, or blockwise 128x128 with the BF16 layers).

    Raises:
        ConfigError: a per-tensor (non-blockwise) FP8 rollout, which the blockwise refit cannot feed.
    """
    vllm_cfg = config.policy.generation.vllm_cfg
    if not config.rollout_blockwise:
        raise ConfigError(
            "policy.generation.vllm_cfg.quantization_config has no weight_block_size: the GRPO refit sends "
            "128x128 blockwise FP8; set weight_block_size: [128, 128] (or drop quantization_config)"
        )
    qc = vllm_cfg.quantization_config
    kws = vllm_cfg.quantization_ignored_layer_kws
    if qc is not None:
        ignored = list(qc.ignored_layers)
        if kws:  # NeMo-RL's quantization_ignored_layer_kws apply on top of an explicit config too
            matched = build_quantization_config(model_path, keep_router_bf16=False, ignored_layer_kws=kws)
            ignored += [m for m in matched["ignored_layers"] if m not in ignored]
        return {
            "quant_method": qc.quant_method or "fp8",
            "fmt": qc.fmt or "e4m3",
            "activation_scheme": qc.activation_scheme or "dynamic",
            "weight_block_size": list(qc.weight_block_size or (128, 128)),
            "ignored_layers": ignored,
        }
    return build_quantization_config(
        model_path,
        num_first_layers_in_bf16=vllm_cfg.num_first_layers_in_bf16,
        num_last_layers_in_bf16=vllm_cfg.num_last_layers_in_bf16,
        ignored_layer_kws=kws,
    )


def fp8_manifest(config: RunConfig, model_path: Path, qcfg: dict) -> Manifest:
    """vLLM's FP8 manifest for the run, asked once (cached across runs by fingerprint).

    A stored manifest with a matching fingerprint is reused. Otherwise vLLM is asked in a
    child process (so its process-global state never meets the trainer's process group) and
    the stored answer is read back.

    Args:
        config: the run configuration (BF16 first/last layers of the rollout).
        model_path: the HF checkpoint folder.
        qcfg: :func:`rollout_quantization_config` of the run.

    Returns:
        The :class:`bridge_mappings.manifest.Manifest`.

    Raises:
        ManifestError: vLLM is not installed, or failed to answer (its output is in the message).
    """
    vllm_cfg = config.policy.generation.vllm_cfg
    first, last = vllm_cfg.num_first_layers_in_bf16, vllm_cfg.num_last_layers_in_bf16
    expected = make_fingerprint(model_path, qcfg, num_first_layers_in_bf16=first, num_last_layers_in_bf16=last)
    if vllm_version() is None:
        raise ManifestError(
            "vLLM is not installed, and the FP8 manifest must come from vLLM itself (never from name rules); "
            "install vllm (make install) or run the FP8 arms where vLLM is"
        )
    store = ManifestStore()
    refresh = False
    try:
        stored = store.load(model_path, expected)
    except ManifestError as exc:
        logger.warning("%s -- asking vLLM again", exc)
        stored, refresh = None, True
    if stored is not None:
        logger.info("FP8 manifest: reusing %s (%d FP8 weights)", store.path_for(model_path), len(stored.fp8_params))
        return stored
    logger.info("FP8 manifest: asking vLLM %s once for %s (stored for later runs)", vllm_version(), model_path)
    cmd = [
        sys.executable,
        "-c",
        _ASK_SCRIPT,
        str(model_path),
        json.dumps(qcfg),
        str(first),
        str(last),
        "1" if refresh else "0",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ASK_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise ManifestError(
            f"asking vLLM for the FP8 manifest of {model_path} failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-3000:]}\nRun `megatron-fp8 manifest --model {model_path}` to see the full error."
        )
    stored = store.load(model_path, expected)
    if stored is None:
        raise ManifestError(f"vLLM answered but no manifest was stored at {store.path_for(model_path)}")
    return stored
