"""What a run keeps and leaves behind: step and arm results, the output folder, metric loggers, the summary and
plot, and checkpoints (their files and resume)."""
