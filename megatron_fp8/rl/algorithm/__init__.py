"""The arithmetic of a GRPO step, free of I/O and processes: token batches and group advantages, the importance-
sampling correction and PPO loss, the KL penalty, train/rollout mismatch metrics and FP8 KV-scale calibration."""
