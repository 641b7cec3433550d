"""Rollout: the engines that generate GRPO responses and receive refits.

* :mod:`~megatron_fp8.rollout.engines`: the :class:`~megatron_fp8.rollout.engines.RolloutEngine`
  protocol, its implementations (``reference``, ``vllm``) and how a run picks one;
* :mod:`~megatron_fp8.rollout.vllm`: the real vLLM engine (adapter over vLLM versions, refit applier,
  worker extension); needs vLLM;
* :mod:`~megatron_fp8.rollout.reference`: the CPU reference FP8 engine, an emulator and oracle of
  vLLM's FP8 W8A8 blockwise numerics (not a serving engine), and its refit applier.

Nothing is imported here: import the submodule you need.
"""
