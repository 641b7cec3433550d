"""models stage (see megatron_fp8 package docstring)."""
