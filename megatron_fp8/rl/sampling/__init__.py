"""What a step trains on: the rollout of a data batch, its scores, and DAPO's dynamic sampling over rounds."""
