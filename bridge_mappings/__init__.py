"""HF-name layer on Megatron-Bridge and the FP8 manifest asked of vLLM once.

* :mod:`bridge_mappings.adapter`: the Megatron-Bridge boundary, the only module that imports
  ``megatron.bridge`` (load, HF-named export, quantizing export, mixed-precision config, the
  bridge's types for annotations); every Megatron-Bridge version difference lives there;
* ``bridge_mappings._patches``: private, version-gated patches to Megatron-Bridge (TE import
  stand-ins, ``SequentialMLP`` expert export), applied only by
  :func:`bridge_mappings.adapter.import_bridge`;
* :mod:`bridge_mappings.manifest`: which HF parameters vLLM holds in FP8 (vLLM's own decision,
  stored with a fingerprint and reused);
* :mod:`bridge_mappings.quantized_export`: the refit stream: FP8 + ``_scale_inv`` for manifest
  names, BF16 for the rest, checked against the manifest.
"""
