"""Where each GRPO process runs and how they talk: device binding, colocated or separate roles and their process
groups, the data-parallel helpers and the remote rollout server."""
