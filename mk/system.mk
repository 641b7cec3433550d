# System packages the Slurm tests need (tests/slurm): Debian's slurm-wlm, installed only when
# slurmctld is missing and we are root with apt-get; otherwise say why nothing is installed.
# Idempotent: a second run finds slurmctld and does nothing.  `make test` depends on it.
SYSTEM_PACKAGES ?= slurm-wlm

.PHONY: system-deps

system-deps:
	@if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1; then \
	    echo ">> system-deps: slurm already installed ($$(slurmctld -V 2>/dev/null)); nothing to do"; \
	elif [ "$$(id -u)" != "0" ]; then \
	    echo ">> system-deps: skipped: slurmctld missing and not root (Slurm tests will skip; run 'sudo make system-deps')"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	    echo ">> system-deps: skipped: slurmctld missing and no apt-get (install Slurm with your package manager; Slurm tests will skip)"; \
	else \
	    echo ">> system-deps: installing $(SYSTEM_PACKAGES) with apt-get"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -q && apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES); \
	fi
