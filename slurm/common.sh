#!/bin/bash
# shellcheck shell=bash
#
# Shared helpers for the megatron-fp8 sbatch scripts (slurm/*.sbatch).
#
# Sourced by every sbatch script after it has set MFP8_REPO_ROOT (the checkout, by default the directory
# sbatch was called from: run `sbatch slurm/X.sbatch` from the repository root). It provides:
#
#   logging          mfp8_info / mfp8_warn / mfp8_die (timestamped, job id and host, on stderr)
#   mfp8_init        results dir, REQUIRE_GPU/REQUIRE_HOPPER defaults, container or host environment, rendezvous
#   mfp8_rendezvous  MASTER_ADDR (first host of the allocation), MASTER_PORT, WORLD_SIZE from SLURM_*
#   mfp8_preflight   per-node checks (srun, one task per node): GPUs, Hopper, image file, mount sources
#   mfp8_srun        srun a command in every task: inside the pyxis container when CONTAINER_IMAGE is set,
#                    in the host environment (the repository's .venv when present) when it is empty
#
# Run directly (this is what mfp8_srun and mfp8_preflight do on the compute nodes):
#
#   bash slurm/common.sh task -- CMD ARGS...   set RANK/LOCAL_RANK/NODE_RANK/MFP8_ROLE from SLURM_*, exec CMD
#   bash slurm/common.sh check-node            run the per-node checks and exit 0, or 1 with the reason
#
# Environment (all optional):
#   CONTAINER_IMAGE     pyxis image: a .sqsh file (`make image-sqsh`) or a registry image (nvcr.io#org/img:tag);
#                       empty = host environment
#   CONTAINER_MOUNTS    extra mounts, comma separated SRC:DST[:FLAGS]; every SRC must exist on every node
#   MOUNT_REPO          1 (default): mount the checkout into the container at the same path and run from it
#                       (PYTHONPATH=<checkout> in every task, so its megatron_fp8 shadows the image's copy);
#                       0: run the copy installed in the image (/opt/megatron-fp8)
#   RESULTS_DIR         where results land (default results/<job name>-<job id> under the checkout)
#   REQUIRE_GPU         1: fail unless every node has an NVIDIA GPU. Default: 1 when the job asked for GPUs
#                       or runs in a container (the cluster path), else 0 (a CPU run)
#   REQUIRE_HOPPER      1: fail unless every GPU is Hopper, compute capability 9.x (blockwise FP8); default 0
#   GPU_BIND            task (default): multi-task steps of a GPU job run with srun --gpus-per-task=1 (one GPU
#                       per rank); none: every task sees the node's GPUs and selects cuda:LOCAL_RANK. Either way
#                       megatron_fp8.rl.cluster.devices checks that no two ranks of a node use the same GPU
#   MODEL_PATH          model folder checked on every node (grpo.sbatch derives it from model.name_or_path)
#   MASTER_ADDR         default: first host of SLURM_JOB_NODELIST;  MASTER_PORT  default: 10000 + job id % 10000
#                       (below Linux's ephemeral range 32768-60999, so no outgoing connection holds it)
#   ROLLOUT_TASKS       tasks (the last ones) that only generate; 0 (default) = colocated, every task trains
#                       and generates. Each task sees MFP8_ROLE=trainer|rollout|colocated.

# ----------------------------------------------------------------------------------------------- logging
mfp8_log() {
    local level=$1
    shift
    printf '%s %-5s [%s%s] %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$level" \
        "${SLURM_JOB_ID:+job $SLURM_JOB_ID }" "$(hostname -s 2>/dev/null || echo '?')" "$*" >&2
}
mfp8_info() { mfp8_log INFO "$@"; }
mfp8_warn() { mfp8_log WARN "$@"; }
mfp8_die() {
    mfp8_log ERROR "$@"
    exit 1
}

# ---------------------------------------------------------------------------------------------- helpers
# True when the job asked Slurm for GPUs (any of the ways sbatch/srun can express it).
mfp8_job_requested_gpus() {
    local v
    for v in "${SLURM_GPUS:-}" "${SLURM_GPUS_ON_NODE:-}" "${SLURM_GPUS_PER_NODE:-}" "${SLURM_GPUS_PER_TASK:-}" \
        "${SLURM_JOB_GPUS:-}" "${SLURM_STEP_GPUS:-}"; do
        if [[ -n $v && $v != 0 ]]; then
            return 0
        fi
    done
    [[ ${SLURM_TRES_PER_NODE:-}${SLURM_TRES_PER_TASK:-}${SLURM_JOB_GRES:-} == *gpu* ]]
}

# mfp8_split_words NAME STRING: split STRING into the array NAME like a shell would (quotes group words; no
# expansion, no command substitution). For the PYTEST_ARGS / GRPO_CMD / BENCH_ARGS style variables.
mfp8_split_words() {
    local -n _mfp8_out=$1
    _mfp8_out=()
    [[ -n ${2// /} ]] || return 0
    printf '%s' "$2" | xargs -r printf '' 2>/dev/null || mfp8_die "cannot split '$2' into words (unbalanced quotes?)"
    mapfile -t -d '' _mfp8_out < <(printf '%s' "$2" | xargs -r printf '%s\0')
}

# Absolute path of $1 (relative paths are taken from the checkout).
mfp8_abspath() {
    local p=$1
    [[ $p == /* ]] || p="$MFP8_REPO_ROOT/$p"
    printf '%s\n' "$p"
}

# True when CONTAINER_IMAGE names a file (a squashfs from `make image-sqsh`) rather than a registry image.
mfp8_image_is_file() {
    local img=${CONTAINER_IMAGE:-}
    [[ $img == /* || $img == ./* || $img == ../* || $img == *.sqsh || $img == *.squashfs ]]
}

# ----------------------------------------------------------------------------------------- node checks
# Fails (exit 1, with the reason and the remedy) when this node cannot run the job.
mfp8_check_node() {
    local host
    host=$(hostname -s 2>/dev/null || echo '?')

    if [[ -n ${CONTAINER_IMAGE:-} ]] && mfp8_image_is_file && [[ ! -f $CONTAINER_IMAGE ]]; then
        mfp8_die "container image file '$CONTAINER_IMAGE' not found on node $host: build it with" \
            "'make image-sqsh' (into a directory every node can read) or set CONTAINER_IMAGE to a registry" \
            "image such as nvcr.io#org/megatron-fp8:TAG; unset CONTAINER_IMAGE to use the host environment"
    fi

    local mount src
    local -a mounts=()
    IFS=',' read -r -a mounts <<<"${CONTAINER_MOUNTS:-}"
    for mount in "${mounts[@]}"; do
        [[ -n $mount ]] || continue
        src=${mount%%:*}
        if [[ ! -e $src ]]; then
            mfp8_die "mount source '$src' (from CONTAINER_MOUNTS entry '$mount') does not exist on node $host:" \
                "create it, fix the path, or drop the entry"
        fi
    done

    if [[ -n ${MODEL_PATH:-} ]] && [[ ! -d $MODEL_PATH || ! -f $MODEL_PATH/config.json ]]; then
        mfp8_die "model folder '$MODEL_PATH' is missing on node $host (or has no config.json): stage the" \
            "weights on the shared file system every node mounts (docs/cluster.md, 'Stage the model weights')"
    fi

    if [[ ${REQUIRE_GPU:-0} == 1 ]]; then
        if ! command -v nvidia-smi >/dev/null 2>&1; then
            mfp8_die "no GPUs on node $host: nvidia-smi not found (no NVIDIA driver). Submit to a GPU" \
                "partition (e.g. --gpus-per-node=8) or set REQUIRE_GPU=0 for a CPU run"
        fi
        local gpus
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        if [[ ${gpus:-0} -eq 0 ]]; then
            mfp8_die "no GPUs on node $host: 'nvidia-smi -L' lists none (CUDA_VISIBLE_DEVICES=" \
                "${CUDA_VISIBLE_DEVICES:-unset}). Ask Slurm for GPUs (--gpus-per-node=N) or set REQUIRE_GPU=0"
        fi
        mfp8_info "node $host: $gpus GPU(s)"
    fi

    if [[ ${REQUIRE_HOPPER:-0} == 1 ]]; then
        if ! command -v nvidia-smi >/dev/null 2>&1; then
            mfp8_die "REQUIRE_HOPPER=1 but node $host has no nvidia-smi: blockwise FP8 needs Hopper GPUs" \
                "(compute capability 9.x); run on H100/H200 nodes or choose the tensorwise recipe"
        fi
        local idx name cap major seen=0
        while IFS=',' read -r idx name cap; do
            [[ -n ${idx// /} ]] || continue
            seen=$((seen + 1))
            cap=${cap// /}
            major=${cap%%.*}
            if ! [[ $major =~ ^[0-9]+$ ]]; then
                mfp8_die "node $host: cannot read the compute capability of GPU $idx ('$cap' from nvidia-smi);" \
                    "update the driver or set REQUIRE_HOPPER=0"
            fi
            if ((major < 9)); then
                mfp8_die "node $host: GPU $idx ($name, compute capability $cap) is not Hopper: blockwise FP8" \
                    "(128x128 block scales) needs compute capability 9.x and CUDA >= 12.9. Run on H100/H200" \
                    "nodes, or use the tensorwise recipe and set REQUIRE_HOPPER=0"
            fi
            if ((major > 9)); then
                mfp8_die "node $host: GPU $idx ($name, compute capability $cap) is not Hopper: blockwise FP8" \
                    "here (TE Float8BlockScaling + vLLM/DeepGEMM block FP8) is built and validated for" \
                    "compute capability 9.x only. Run on H100/H200 nodes, or use the tensorwise recipe and set" \
                    "REQUIRE_HOPPER=0"
            fi
        done < <(nvidia-smi --query-gpu=index,name,compute_cap --format=csv,noheader 2>/dev/null || true)
        ((seen > 0)) || mfp8_die "node $host: nvidia-smi reports no GPU compute capability (no GPU visible);" \
            "ask Slurm for GPUs or set REQUIRE_HOPPER=0"
        mfp8_info "node $host: $seen GPU(s) with compute capability 9.x (Hopper)"
    fi
    return 0
}

# ------------------------------------------------------------------------------------------ rendezvous
# Exports MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NNODES for torch.distributed (env://) from the Slurm job.
mfp8_rendezvous() {
    if [[ -z ${MASTER_ADDR:-} ]]; then
        if [[ -n ${SLURM_JOB_NODELIST:-} ]] && command -v scontrol >/dev/null 2>&1; then
            # whole output first, then its first line: an early-exiting reader would SIGPIPE scontrol under pipefail
            local hosts
            hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || hosts=
            MASTER_ADDR=${hosts%%$'\n'*}
        else
            MASTER_ADDR=127.0.0.1
        fi
    fi
    [[ -n $MASTER_ADDR ]] || mfp8_die "cannot derive MASTER_ADDR from SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}';" \
        "set MASTER_ADDR to the first node's hostname"
    local job=${SLURM_JOB_ID:-0}
    MASTER_PORT=${MASTER_PORT:-$((10000 + job % 10000))}
    if ! [[ $MASTER_PORT =~ ^[0-9]+$ ]] || ((MASTER_PORT < 1024 || MASTER_PORT > 65535)); then
        mfp8_die "MASTER_PORT='$MASTER_PORT' is not a port in 1024..65535"
    fi
    WORLD_SIZE=${SLURM_NTASKS:-${WORLD_SIZE:-1}}
    NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    export MASTER_ADDR MASTER_PORT WORLD_SIZE NNODES
}

# Per-task variables (runs inside each srun task, container or not).
mfp8_task_env() {
    RANK=${SLURM_PROCID:-${RANK:-0}}
    LOCAL_RANK=${SLURM_LOCALID:-${LOCAL_RANK:-0}}
    NODE_RANK=${SLURM_NODEID:-${NODE_RANK:-0}}
    WORLD_SIZE=${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:-${WORLD_SIZE:-1}}}
    local per_node=${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}
    LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-${per_node%%(*}}
    local rollout=${ROLLOUT_TASKS:-0}
    if ((rollout == 0)); then
        MFP8_ROLE=colocated
    elif ((RANK >= WORLD_SIZE - rollout)); then
        MFP8_ROLE=rollout
    else
        MFP8_ROLE=trainer
    fi
    export RANK LOCAL_RANK NODE_RANK WORLD_SIZE LOCAL_WORLD_SIZE MFP8_ROLE
    if [[ ${MFP8_IN_CONTAINER:-0} == 1 ]]; then
        # the image's packages only: no ~/.local site-packages shadowing them
        export PYTHONNOUSERSITE=1
        if [[ ${MOUNT_REPO:-1} == 1 ]]; then
            # the mounted checkout, not the copy installed in the image
            export PYTHONPATH=$MFP8_WORKDIR${PYTHONPATH:+:$PYTHONPATH}
        fi
    fi
}

# -------------------------------------------------------------------------------------------- setup
# Results dir, requirement defaults, container/host environment, rendezvous. Call once in the batch script.
mfp8_init() {
    : "${MFP8_REPO_ROOT:?set MFP8_REPO_ROOT before sourcing slurm/common.sh}"
    RESULTS_DIR=$(mfp8_abspath "${RESULTS_DIR:-results/${SLURM_JOB_NAME:-local}-${SLURM_JOB_ID:-$$}}")
    mkdir -p "$RESULTS_DIR" || mfp8_die "cannot create RESULTS_DIR '$RESULTS_DIR'"
    export RESULTS_DIR

    if [[ -z ${REQUIRE_GPU:-} ]]; then
        if mfp8_job_requested_gpus || [[ -n ${CONTAINER_IMAGE:-} ]]; then REQUIRE_GPU=1; else REQUIRE_GPU=0; fi
    fi
    [[ $REQUIRE_GPU == 0 || $REQUIRE_GPU == 1 ]] || mfp8_die "REQUIRE_GPU='$REQUIRE_GPU': use 0 or 1"
    REQUIRE_HOPPER=${REQUIRE_HOPPER:-0}
    [[ $REQUIRE_HOPPER == 0 || $REQUIRE_HOPPER == 1 ]] || mfp8_die "REQUIRE_HOPPER='$REQUIRE_HOPPER': use 0 or 1"
    if [[ $REQUIRE_HOPPER == 1 ]]; then REQUIRE_GPU=1; fi
    GPU_BIND=${GPU_BIND:-task}
    [[ $GPU_BIND == task || $GPU_BIND == none ]] || mfp8_die "GPU_BIND='$GPU_BIND': use task or none"
    export REQUIRE_GPU REQUIRE_HOPPER GPU_BIND

    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        if mfp8_image_is_file; then
            CONTAINER_IMAGE=$(mfp8_abspath "$CONTAINER_IMAGE")
            [[ -f $CONTAINER_IMAGE ]] || mfp8_die "container image file '$CONTAINER_IMAGE' not found: run" \
                "'make image-sqsh' or set CONTAINER_IMAGE to a registry image; unset it for the host environment"
        fi
        local srun_help
        # captured whole: piping into an early-exiting grep would SIGPIPE srun under pipefail
        srun_help=$(srun --help 2>&1) || true
        if [[ $srun_help != *--container-image* ]]; then
            mfp8_die "CONTAINER_IMAGE is set but srun has no --container-image: the pyxis plugin is not" \
                "installed on this cluster. Unset CONTAINER_IMAGE to run in the host environment"
        fi
        local mount_list="$RESULTS_DIR:$RESULTS_DIR"
        if [[ ${MOUNT_REPO:-1} == 1 ]]; then
            MFP8_WORKDIR=$MFP8_REPO_ROOT
            if [[ $RESULTS_DIR == "$MFP8_REPO_ROOT"/* ]]; then
                mount_list="$MFP8_REPO_ROOT:$MFP8_REPO_ROOT"
            else
                mount_list="$MFP8_REPO_ROOT:$MFP8_REPO_ROOT,$mount_list"
            fi
        else
            MFP8_WORKDIR=/opt/megatron-fp8
        fi
        MFP8_CONTAINER_MOUNTS=$mount_list${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}
        MFP8_PYTHON=python
        MFP8_IN_CONTAINER=1
        export CONTAINER_IMAGE MFP8_CONTAINER_MOUNTS MFP8_IN_CONTAINER MOUNT_REPO=${MOUNT_REPO:-1}
        mfp8_info "environment: container $CONTAINER_IMAGE (workdir $MFP8_WORKDIR, mounts $MFP8_CONTAINER_MOUNTS)"
    else
        MFP8_WORKDIR=$MFP8_REPO_ROOT
        if [[ -x $MFP8_REPO_ROOT/.venv/bin/python ]]; then
            export VIRTUAL_ENV=$MFP8_REPO_ROOT/.venv
            export PATH="$VIRTUAL_ENV/bin:$PATH"
            MFP8_PYTHON=$VIRTUAL_ENV/bin/python
            mfp8_info "environment: host, $VIRTUAL_ENV"
        else
            MFP8_PYTHON=$(command -v python3 || command -v python || true)
            [[ -n $MFP8_PYTHON ]] || mfp8_die "host environment has no python3 and $MFP8_REPO_ROOT/.venv is" \
                "missing: run 'make install' in the checkout or set CONTAINER_IMAGE"
            mfp8_info "environment: host, $MFP8_PYTHON (no .venv in $MFP8_REPO_ROOT)"
        fi
    fi
    export MFP8_REPO_ROOT MFP8_WORKDIR MFP8_PYTHON

    mfp8_rendezvous
    mfp8_info "rendezvous: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT WORLD_SIZE=$WORLD_SIZE NNODES=$NNODES"
    mfp8_info "results: $RESULTS_DIR  REQUIRE_GPU=$REQUIRE_GPU REQUIRE_HOPPER=$REQUIRE_HOPPER"
    {
        printf '# megatron-fp8 job environment (slurm/common.sh)\n'
        local var
        for var in SLURM_JOB_ID SLURM_JOB_NAME SLURM_JOB_NODELIST SLURM_NTASKS NNODES MASTER_ADDR MASTER_PORT \
            WORLD_SIZE CONTAINER_IMAGE MFP8_CONTAINER_MOUNTS MFP8_WORKDIR MFP8_PYTHON REQUIRE_GPU REQUIRE_HOPPER \
            GPU_BIND MODEL_PATH ROLLOUT_TASKS RESULTS_DIR; do
            printf '%s=%q\n' "$var" "${!var:-}"
        done
    } >"$RESULTS_DIR/job.env"
}

# One task per node runs mfp8_check_node on the host (before any container starts).
mfp8_preflight() {
    local nodes=${SLURM_JOB_NUM_NODES:-1}
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 \
            bash "$MFP8_REPO_ROOT/slurm/common.sh" check-node ||
            mfp8_die "preflight failed on at least one node (reason above)"
    else
        mfp8_check_node
    fi
    mfp8_info "preflight ok on $nodes node(s)"
}

# mfp8_rank_binding NAME: the srun options giving each rank of a multi-task step its own GPU, into array NAME:
# --gpus-per-task=1 when the job asked Slurm for GPUs and GPU_BIND=task (default), else none (then every task sees
# the node's GPUs and megatron_fp8.rl.cluster.devices selects cuda:LOCAL_RANK). Either way the ranks check at start-up
# that no two of them on a node use the same GPU.
mfp8_rank_binding() {
    local -n _mfp8_bind=$1
    _mfp8_bind=()
    if [[ ${GPU_BIND:-task} == task ]] && mfp8_job_requested_gpus; then
        _mfp8_bind=(--gpus-per-task=1)
    fi
}

# mfp8_srun [SRUN OPTIONS...] -- CMD ARGS...: run CMD in every task of a job step.
mfp8_srun() {
    local -a srun_args=() container_args=()
    while (($#)) && [[ $1 != -- ]]; do
        srun_args+=("$1")
        shift
    done
    (($#)) || mfp8_die "mfp8_srun: missing '--' before the command"
    shift
    (($#)) || mfp8_die "mfp8_srun: no command after '--'"
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        container_args=(--container-image="$CONTAINER_IMAGE" --container-mounts="$MFP8_CONTAINER_MOUNTS"
            --container-workdir="$MFP8_WORKDIR" --no-container-mount-home)
    else
        srun_args+=(--chdir="$MFP8_WORKDIR")
    fi
    mfp8_info "step: srun ${srun_args[*]} ${container_args[*]} -- $*"
    srun --kill-on-bad-exit=1 "${srun_args[@]}" "${container_args[@]}" \
        bash "$MFP8_WORKDIR/slurm/common.sh" task -- "$@"
}

# ------------------------------------------------------------------------------------- direct execution
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    case ${1:-} in
    task)
        shift
        [[ ${1:-} == -- ]] && shift
        (($#)) || mfp8_die "usage: common.sh task -- CMD ARGS..."
        mfp8_task_env
        exec "$@"
        ;;
    check-node)
        mfp8_check_node
        ;;
    *)
        mfp8_die "usage: bash slurm/common.sh task -- CMD ARGS... | bash slurm/common.sh check-node" \
            "(sbatch scripts source this file)"
        ;;
    esac
fi
