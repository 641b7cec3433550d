"""What makes a refit bucket trustworthy: its position-sensitive checksum (and the Triton kernel that computes it
on CUDA) and the NaN/Inf probe of the tensors it carries."""
