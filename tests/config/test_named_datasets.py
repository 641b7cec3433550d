"""NeMo-RL's named datasets read from local files (issue 38 item 2): a ``dataset_name`` with a staged ``data_path``
reads the columns, split and held-out share NeMo-RL's dataset class uses; lists of datasets run (one entry) or are
refused naming the key. The NeMo-RL files are the shipped copies under ``tests/config/data/nemo_rl`` (commit
7ea279a); every data file is generated here (no network)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import _warm_cli
import pytest
import yaml

from megatron_fp8.config import load_config
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.config.nemo_rl.datasets import NAMED_DATASETS, column_value
from megatron_fp8.config.nemo_rl.prompts import NEMO_RL_PROMPTS
from megatron_fp8.config.refusals import refuse_before_run
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.data.problems import problem_source

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "config" / "data" / "nemo_rl" / "examples" / "configs"
FP8_8B = CONFIGS / "grpo_math_8B_megatron_fp8.yaml"


def _omi2(path: Path, n: int = 40) -> Path:
    """Rows as nvidia/OpenMathInstruct-2 holds them (its four columns)."""
    rows = [
        {
            "problem": f"What is {i} + {i}?",
            "generated_solution": f"{i} + {i} = \\boxed{{{2 * i}}}",
            "expected_answer": str(2 * i),
            "problem_source": "augmented_math",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dapo(path: Path, n: int = 6) -> Path:
    """Rows as BytedTsinghua-SIA/DAPO-Math-17k holds them: the problem inside a chat message, the answer nested."""
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": f"Solve {i} * 3. Answer: $Answer", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(3 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(i)},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_nemo_rls_8b_fp8_file_with_openmathinstruct2_staged_is_approved_with_nemo_rls_values(tmp_path):
    """The done-when of issue 38: NeMo-RL's 8B FP8 file, only data.train.data_path set, `config` approves it with
    OpenMathInstruct-2's columns, 5% held out for validation (seed grpo.seed) and NeMo-RL's cot prompt."""
    staged = _omi2(tmp_path / "openmathinstruct2_train_1M.jsonl")
    proc = _warm_cli.run(
        ["config", "--config", str(FP8_8B), f"data.train.data_path={staged}"],
        timeout=300,
        cwd=tmp_path,  # no examples/prompts/cot.txt here: NeMo-RL's text is used
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "approved: every check" in proc.stdout
    assert "data.train.dataset_name=OpenMathInstruct-2 read from" in proc.stderr
    assert "split train_1M, 0.05 held out for validation" in proc.stderr
    assert "using NeMo-RL's examples/prompts/cot.txt" in proc.stderr
    data = yaml.safe_load("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("#")))["data"]
    assert data["train"] == {
        "data_path": str(staged),
        "input_key": "problem",
        "output_key": "expected_answer",
        "max_samples": None,
        "split_validation_size": 0.05,
        "seed": 42,
    }
    assert data["validation"] is None and data["default"]["env_name"] == "math"
    # no longer "no effect": dataset_name and split are read
    no_effect = proc.stderr[proc.stderr.index("no effect in megatron-fp8") :].split("INFO")[0]
    assert "dataset_name" not in no_effect and "split_validation_size" not in no_effect


def test_nemo_rls_70b_fp8_file_on_its_64_ranks_is_approved_with_its_rollout_tp_8(tmp_path):
    """Issue 53: NeMo-RL's 70B FP8 recipe (trainer TP 4 x PP 8, DP 2 on 8 nodes of 8 GPUs, rollout TP 8) with its data
    staged: each engine of 8 consecutive ranks holds one pipeline stage of both replicas; the memory plan is printed,
    the engine shard's part (72.7 GB of FP8 weights / 8) staged and snapshotted on the GPU, no refit version in host
    memory (host memory per rank: the offloaded optimizer state only)."""
    staged = _omi2(tmp_path / "openmathinstruct2_train_1M.jsonl")
    proc = _warm_cli.run(
        ["config", "--config", str(CONFIGS / "grpo_math_70B_megatron_fp8.yaml"), f"data.train.data_path={staged}"],
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "WORLD_SIZE": "64", "RANK": "0", "LOCAL_WORLD_SIZE": "8"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "approved: every check" in proc.stdout
    assert (
        "# rollout (64 processes): 64 ranks: 8 engine(s) of TP 8, each sharded over 8 consecutive trainer ranks (vLLM "
        "external_launcher) holding one pipeline stage of 2 replicas" in proc.stdout
    )
    refit = next(line for line in proc.stdout.splitlines() if line.startswith("#   refit:"))
    assert "refit's staged version 9.1 GB" in refit and "rollback snapshot (engine weights) 9.1 GB" in refit
    peak = next(line for line in proc.stdout.splitlines() if line.startswith("#   peak:"))
    assert ": fits; host memory per rank +13.2 GB" in peak  # the optimizer state offloaded (12 B x params / TP x PP)
    optimizer = next(line for line in proc.stdout.splitlines() if line.startswith("#   training:"))
    assert "optimizer state 13.2 GB" in optimizer  # so no refit byte is in host memory


def test_the_staged_file_yields_nemo_rls_problems_answers_and_held_out_rows(tmp_path, monkeypatch):
    """The problem source of that config: NeMo-RL's prompt around each problem, the expected answers, and
    ceil(0.05 * n) rows held out (never trained on), validated by grpo.val_period without a validation file."""
    monkeypatch.chdir(tmp_path)
    staged = _omi2(tmp_path / "train.jsonl", n=40)
    cfg = load_config(FP8_8B, [f"data.train.data_path={staged}", "data.max_input_seq_length=null"])
    assert cfg.grpo.val_period == 10  # NeMo-RL's file validates: the held-out rows make that possible
    source = problem_source(cfg, None)
    train = source.step_problems(step=0, count=40)
    held = source.validation_problems(limit=None)
    assert len(held) == math.ceil(0.05 * 40) == 2
    assert len({p.prompt for p in train}) == 38 and not {p.prompt for p in held} & {p.prompt for p in train}
    template = NEMO_RL_PROMPTS["examples/prompts/cot.txt"]
    for problem in train + held:
        number = int(problem.prompt.split("What is ")[1].split(" ")[0])
        assert problem.prompt == template.format(f"What is {number} + {number}?")
        assert problem.answer == str(2 * number)
    assert "held out (split_validation_size 0.05, seed 42): 2 rows" in source.describe()


def test_the_held_out_rows_are_the_ones_nemo_rl_holds_out(tmp_path):
    """The same file and seed hold out the same rows as NeMo-RL's Hugging Face train_test_split."""
    datasets = pytest.importorskip("datasets")
    from megatron_fp8.rl.data.holdout import hold_out

    rows = [{"problem": f"p{i}", "expected_answer": str(i)} for i in range(97)]
    for size, seed in ((0.05, 42), (0.3, 7), (10, 42), (1, 0)):
        theirs = datasets.Dataset.from_list(rows).train_test_split(test_size=size, seed=seed)
        ours = hold_out(rows, size=float(size), seed=seed, key="k")
        assert ours.validation == theirs["test"].to_list() and ours.train == theirs["train"].to_list()


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (-0.1, r"expected 0 \(none\), a fraction"),
        (2.5, "must be whole"),
        (40, "leaving none to train on"),
    ],
)
def test_a_bad_hold_out_is_refused_naming_the_key(tmp_path, size, message):
    staged = _omi2(tmp_path / "train.jsonl")
    cfg = load_config(
        FP8_8B,
        [
            f"data.train.data_path={staged}",
            "data.max_input_seq_length=null",
            f"data.train.split_validation_size={size}",
        ],
    )
    with pytest.raises(ConfigError, match=rf"data\.train\.split_validation_size={size}.*{message}"):
        problem_source(cfg, None)


def test_dapo_math_reads_its_nested_columns_and_holds_nothing_out(tmp_path):
    """NeMo-RL's DAPOMath17K / DAPOMathAIME2024 (the FP8 kv-cache recipe): the problem is the first chat message's
    content, the answer reward_model.ground_truth; the class holds no rows out."""
    train, val = _dapo(tmp_path / "dapo.jsonl"), _dapo(tmp_path / "aime.jsonl", n=3)
    cfg = load_config(
        CONFIGS / "recipes/llm/grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml",
        [f"data.train.data_path={train}", f"data.validation.data_path={val}", "data.max_input_seq_length=null"],
    )
    assert (cfg.data.train.input_key, cfg.data.train.output_key) == ("prompt[0].content", "reward_model.ground_truth")
    assert cfg.data.train.split_validation_size == 0 and cfg.data.validation.input_key == "prompt[0].content"
    source = problem_source(cfg, None)
    assert source.step_problems(step=0, count=1)[0].answer in {str(3 * i) for i in range(6)}
    assert [p.answer for p in source.validation_problems(limit=None)] == ["0", "3", "6"]
    assert source.validation_problems(limit=None)[1].prompt == "Solve 1 * 3. Answer: $Answer"


@pytest.mark.parametrize(
    ("name", "columns"),
    [(n, (d.input_key, d.output_key)) for n, d in NAMED_DATASETS.items() if n != "ResponseDataset"],
)
def test_each_named_dataset_reads_its_own_columns(tmp_path, name, columns):
    problem_key, answer_key = columns
    row: dict = {}
    for key, value in ((problem_key, "What is 1 + 1?"), (answer_key, "2")):
        if key == "prompt[0].content":
            row["prompt"] = [{"content": value, "role": "user"}]
        elif key == "reward_model.ground_truth":
            row["reward_model"] = {"ground_truth": value}
        else:
            row[key] = value
    staged = tmp_path / "d.jsonl"
    staged.write_text((json.dumps(row) + "\n") * 2)
    cfg = load_config(
        None,
        [f"data.train.dataset_name={name}", f"data.train.data_path={staged}", "data.train.split_validation_size=0"],
    )
    assert (cfg.data.train.input_key, cfg.data.train.output_key) == columns
    problem = problem_source(cfg, None).step_problems(step=0, count=1)[0]
    assert (problem.prompt, problem.answer) == ("What is 1 + 1?", "2")


def test_column_paths_fall_back_to_a_column_of_that_name():
    assert column_value({"a.b": 1, "a": {"b": 2}}, "a.b") == 1
    assert column_value({"a": {"b": [5, {"c": 3}]}}, "a.b[1].c") == 3
    assert column_value({"a": {"b": [5]}}, "a.b[3]") is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.train.input_key=question"],
            r"data\.train\.input_key='question': NeMo-RL's OpenMathInstruct-2 reads the column 'problem'",
        ),
        (["data.train.split=test"], r"data\.train\.split='test': NeMo-RL's OpenMathInstruct-2 has the splits train"),
        (["data.train.dataset_name=gsm8k"], r"'gsm8k': megatron-fp8 does not read this NeMo-RL dataset \(.*####"),
        (["data.train.dataset_name=HelpSteer3"], r"'HelpSteer3': megatron-fp8 does not read"),
        (["data.train.dataset_name=my_pkg.MyDataset"], r"'my_pkg.MyDataset': a custom dataset class"),
        (["data.train.dataset_name=OpenMath"], r"'OpenMath': not a dataset NeMo-RL registers.*OpenMathInstruct-2"),
    ],
)
def test_what_nemo_rl_would_not_read_either_is_refused_naming_the_key(tmp_path, overrides, message):
    staged = _omi2(tmp_path / "train.jsonl", n=4)
    with pytest.raises(ConfigError, match=message):
        load_config(FP8_8B, [f"data.train.data_path={staged}", *overrides])


def test_a_hold_out_on_a_dataset_whose_class_ignores_it_is_ignored_with_a_warning(tmp_path, caplog):
    """NeMo-RL's DeepScaler class takes no split_validation_size (the 0.05 inherited from grpo_math_1B.yaml): it
    trains on every row, and so does megatron-fp8, saying so."""
    staged = _omi2(tmp_path / "train.jsonl", n=4)
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.nemo_rl.datasets"):
        cfg = load_config(FP8_8B, [f"data.train.data_path={staged}", "data.train.dataset_name=DeepScaler"])
    assert cfg.data.train.split_validation_size == 0 and cfg.data.train.output_key == "answer"
    assert "split_validation_size=0.05: NeMo-RL's DeepScaler holds no rows out" in caplog.text


def test_an_output_key_openmathinstruct2_lets_you_set_is_read(tmp_path):
    staged = _omi2(tmp_path / "train.jsonl", n=4)
    cfg = load_config(FP8_8B, [f"data.train.data_path={staged}", "data.train.output_key=generated_solution"])
    assert (cfg.data.train.input_key, cfg.data.train.output_key) == ("problem", "generated_solution")


def test_grpo_multiple_datasets_is_refused_naming_the_key_and_one_entry_runs(tmp_path):
    """NeMo-RL's grpo_multiple_datasets.yaml trains on two datasets: refused naming data.train and them; a list of
    one entry is that entry (NeMo-RL reads a mapping as a one-entry list)."""
    with pytest.raises(ConfigError, match=r"data\.train lists 2 datasets \(OpenMathInstruct-2, DeepScaler\)"):
        load_config(CONFIGS / "grpo_multiple_datasets.yaml")
    staged = _omi2(tmp_path / "train.jsonl", n=20)
    one = tmp_path / "one.yaml"
    one.write_text(
        yaml.safe_dump(
            {
                "defaults": str(FP8_8B),
                "data": {"train": [{"dataset_name": "OpenMathInstruct-2", "data_path": str(staged)}]},
            }
        )
    )
    loaded = load_config_report(one)
    assert loaded.config.data.train.input_key == "problem" and loaded.config.data.train.split_validation_size == 0.05
    assert loaded.translated["data.train.dataset_name"] == "OpenMathInstruct-2"
    refuse_before_run(loaded.config, loaded.no_effect)  # nothing refused


def test_unstaged_names_are_still_refused_before_a_run():
    """Without data_path nothing is read: the run is refused (stage the file), the file still loads."""
    loaded = load_config_report(FP8_8B)
    assert loaded.no_effect["data.train.dataset_name"] == "OpenMathInstruct-2"
    with pytest.raises(ConfigError, match=r"dataset_name='OpenMathInstruct-2' names a Hugging Face dataset"):
        refuse_before_run(loaded.config, loaded.no_effect)
