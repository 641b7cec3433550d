"""``python -m megatron_fp8`` (and ``torchrun ... -m megatron_fp8``): the ``megatron-fp8`` command line."""

from megatron_fp8.cli import main

raise SystemExit(main())
