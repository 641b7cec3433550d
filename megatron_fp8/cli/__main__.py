"""``python -m megatron_fp8.cli``: the ``megatron-fp8`` command line."""

from megatron_fp8.cli import main

raise SystemExit(main())
