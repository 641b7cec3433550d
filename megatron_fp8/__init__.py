"""megatron-fp8: FP8 reinforcement learning on Megatron-Bridge + vLLM.

Data flow of one RL step (the sub-packages follow it)::

    recipes -> megatron (train step) -> bridge_mappings (HF names, FP8 manifest)
      -> quant (blockwise cast) -> refit (buckets, transport) -> vllm (receiver)
      -> rollout -> rl (IS correction, metrics) -> train
"""

__version__ = "0.1.0"
