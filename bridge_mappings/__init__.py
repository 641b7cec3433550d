"""HF-name layer on Megatron-Bridge and the FP8 manifest asked of vLLM once.

* :mod:`bridge_mappings.manifest` — which HF parameters vLLM holds in FP8
  (vLLM's own decision, stored with a fingerprint and reused);
* :mod:`bridge_mappings.quantized_export` — the refit stream: FP8 + ``_scale_inv``
  for manifest names, BF16 for the rest, checked against the manifest;
* :mod:`bridge_mappings.adapter` — every Megatron-Bridge version difference.
"""
