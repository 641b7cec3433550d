"""The GRPO run itself: checks before start, the arms and their steps (rollout -> score -> train -> refit),
validation, the warm start, safe stopping, the FP8 rollout setup and the refit measurement.

Import the entry point from :mod:`megatron_fp8.rl.driver.grpo` (:func:`run_grpo`)."""
