"""The vLLM rollout engine: building and shutting down ``vllm.LLM``, in-place refit, and its worker extension.

vLLM is an optional dependency: this package imports nothing at import time;
import :mod:`~megatron_fp8.rollout.vllm.adapter`, :mod:`~megatron_fp8.rollout.vllm.applier` or
:mod:`~megatron_fp8.rollout.vllm.worker_extension` where vLLM is installed.
"""
