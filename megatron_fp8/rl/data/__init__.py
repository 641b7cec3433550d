"""What the policy is asked and how its answers are scored: problems (a local dataset or the toy task), prompts
and rewards."""
