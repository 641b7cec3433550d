"""GRPO problem sources: dataset files (JSONL, JSON, Parquet), prompt building, length limits, the data position."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import pytest

from megatron_fp8.config.schema import DataConfig, DataDefaultsConfig, DatasetConfig, GRPOConfig, RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.models.tokenizer import BASE_CHARACTERS, save_tokenizer
from megatron_fp8.rl.data.problems import (
    TASK_VALIDATION_PROBLEMS,
    DatasetSource,
    PromptBuilder,
    TaskSource,
    load_rows,
    load_split,
    problem_source,
    read_prompt_template,
)
from megatron_fp8.rl.data.task import Problem, get_task, sample_problems

REPO = Path(__file__).resolve().parents[3]
MATH_TINY = REPO / "data" / "math_tiny"


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The tiny models' character tokenizer, loaded as the run loads it (``AutoTokenizer``)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(folder, model_max_length=512)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _jsonl(path: Path, rows: list[dict], *, extra: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return path


def _rows(n: int) -> list[dict]:
    return [{"input": f"What is {i} + 1?", "output": i + 1} for i in range(n)]


def _config(train: Path | None, *, validation: Path | None = None, **grpo) -> RunConfig:
    data = DataConfig(
        train=DatasetConfig(data_path=str(train) if train else None),
        validation=DatasetConfig(data_path=str(validation)) if validation else None,
    )
    return RunConfig(data=data, grpo=GRPOConfig(**grpo))


# ---- reading files ----------------------------------------------------------------------------------------------


def test_jsonl_rows_in_file_order_and_max_samples(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(5), extra="\n\n")  # trailing blank lines are fine
    assert load_rows(DatasetConfig(data_path=str(path)), what="data.train") == _rows(5)
    assert load_rows(DatasetConfig(data_path=str(path), max_samples=2), what="data.train") == _rows(2)


def test_json_array_and_json_lines_in_a_json_file(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps(_rows(3), indent=2))
    lines = _jsonl(tmp_path / "b.json", _rows(3))
    for path in (array, lines):
        assert load_rows(DatasetConfig(data_path=str(path)), what="data.train") == _rows(3)


def test_parquet_through_datasets_writes_nothing_next_to_the_data(tmp_path):
    pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [
        {"problem": "What is 2 + 2?", "expected_answer": "4"},
        {"problem": "What is 3 * 3?", "expected_answer": "9"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "d.parquet")
    cfg = DatasetConfig(data_path=str(folder / "d.parquet"), input_key="problem", output_key="expected_answer")
    assert load_rows(cfg, what="data.train") == rows
    assert sorted(p.name for p in folder.iterdir()) == ["d.parquet"]


def test_corrupt_parquet_names_the_file(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"data\.train\.data_path: .*bad\.parquet is not a readable Parquet file"):
        load_rows(DatasetConfig(data_path=str(path)), what="data.train")


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("missing.jsonl", None, r"data\.train\.data_path: no such file .*missing\.jsonl"),
        ("d.csv", "input,output\n", r"data\.train\.data_path: .*d\.csv has the unknown extension '\.csv'; use one of"),
        ("empty.jsonl", "\n", r"data\.train\.data_path: .*empty\.jsonl holds no rows"),
        (
            "broken.jsonl",
            '{"input": "a", "output": 1}\n\n{"input": "b", "output": 2\n',
            r"broken\.jsonl line 3 is not JSON \(Expecting ',' delimiter",
        ),
        ("list.jsonl", '{"input": "a", "output": 1}\n[1, 2]\n', r"list\.jsonl line 2 is a JSON list, not an object"),
        ("array.json", '[{"input": "a", "output": 1},\n {"input": }]', r"array\.json is not valid JSON \(line 2"),
        ("scalar.json", "3", r"scalar\.json holds a JSON int; expected an array of objects"),
    ],
)
def test_bad_files_are_refused_by_name(tmp_path, name, content, pattern):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=pattern):
        load_rows(DatasetConfig(data_path=str(path)), what="data.train")


def test_a_folder_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.validation\.data_path: .* is not a file"):
        load_rows(DatasetConfig(data_path=str(tmp_path)), what="data.validation")


def test_missing_input_key_names_the_key_the_columns_and_the_first_bad_row(tmp_path):
    rows = [{"problem": "a", "expected_answer": "1"}, {"question": "b", "expected_answer": "2"}] + [
        {"question": "c", "expected_answer": "3"}
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = DatasetConfig(data_path=str(path), input_key="problem", output_key="expected_answer")
    with pytest.raises(ConfigError) as err:
        load_rows(cfg, what="data.train")
    msg = str(err.value)
    assert "d.jsonl line 2 has no 'problem'" in msg
    assert "its columns: 'question', 'expected_answer'" in msg
    assert "set data.train.input_key to the column holding the problem text" in msg
    assert "(1 more rows like it)" in msg


def test_missing_output_key_with_default_names(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"problem": "a", "expected_answer": "1"}])
    with pytest.raises(ConfigError, match=r"line 1 has no 'input' \(its columns: 'problem', 'expected_answer'\)"):
        load_rows(DatasetConfig(data_path=str(path)), what="data.train")
    with pytest.raises(ConfigError, match=r"line 1 has no 'output' .*set data\.validation\.output_key"):
        load_rows(DatasetConfig(data_path=str(path), input_key="problem"), what="data.validation")


@pytest.mark.parametrize(
    ("row", "pattern"),
    [
        ({"input": "a", "output": None}, r"line 1 has a null 'output'"),
        ({"input": 3, "output": "1"}, r"line 1 has a int 'input' \(3\); the problem must be text"),
        ({"input": "a", "output": [1]}, r"line 1 has a list 'output' .* must be text or a finite number"),
        ({"input": "a", "output": True}, r"line 1 has a bool 'output'"),
    ],
)
def test_bad_values_are_refused(tmp_path, row, pattern):
    path = _jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(ConfigError, match=pattern):
        load_rows(DatasetConfig(data_path=str(path)), what="data.train")


def test_bad_max_samples(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(2))
    with pytest.raises(ConfigError, match=r"data\.train\.max_samples must be >= 1"):
        load_rows(DatasetConfig(data_path=str(path), max_samples=0), what="data.train")


# ---- prompts ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("no placeholder", r"exactly one \{\} placeholder .* found 0 replacement field"),
        ("{} and {}", r"found 2 replacement field\(s\): \{\}, \{\}"),
        ("Solve {problem}", r"found 1 replacement field\(s\): \{problem\}"),
        ("Put it in \\boxed{}: {}", r"found 2 replacement field"),
        ("a { b {}", r"is not a valid template .*write literal braces doubled"),
    ],
)
def test_prompt_file_needs_exactly_one_placeholder(tmp_path, text, pattern):
    path = tmp_path / "prompt.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"data\.default\.prompt_file: .*prompt\.txt"):
        read_prompt_template(str(path))
    with pytest.raises(ConfigError, match=pattern):
        read_prompt_template(str(path))


def test_prompt_file_doubled_braces_and_missing_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("Put the answer in \\boxed{{}}.\n{}\n")
    template = read_prompt_template(str(path))
    assert PromptBuilder(template=template)("1+1") == "Put the answer in \\boxed{}.\n1+1\n"
    with pytest.raises(ConfigError, match=r"data\.default\.prompt_file: no such file .*nope\.txt"):
        read_prompt_template(str(tmp_path / "nope.txt"))


def test_chat_template_with_system_prompt(tmp_path, tiny_tokenizer):
    train = _jsonl(tmp_path / "d.jsonl", _rows(1))
    (tmp_path / "p.txt").write_text("Question: {}")
    (tmp_path / "s.txt").write_text("Be brief.")
    config = _config(train)
    default = DataDefaultsConfig(prompt_file=str(tmp_path / "p.txt"), system_prompt_file=str(tmp_path / "s.txt"))
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, default=default))
    source = problem_source(config, tiny_tokenizer)
    assert source.step_problems(step=0, count=1) == [
        Problem(
            prompt="<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQuestion: What is 0 + 1?<|im_end|>\n"
            "<|im_start|>assistant\n",
            answer="1",
        )
    ]
    # Without a tokenizer (or one without a chat template): the template's text as is.
    assert problem_source(config, None).step_problems(step=0, count=1)[0].prompt == "Question: What is 0 + 1?"


def test_max_input_seq_length_skips_counts_and_warns_once(tmp_path, tiny_tokenizer, caplog):
    rows = [{"input": "x" * n, "output": n} for n in (3, 30, 4, 40)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = DatasetConfig(data_path=str(path))
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.rl.data.problems"):
        split = load_split(
            cfg, what="data.train", build_prompt=PromptBuilder(tokenizer=tiny_tokenizer), max_input_seq_length=20
        )
    assert [p.answer for p in split.problems] == ["3", "4"]
    assert split.describe() == f"data.train: 2 rows from {path} (2 skipped: longer than max_input_seq_length=20)"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert (
        "skipped 2 of 4 rows" in warnings[0] and "(the first: row 2, 38 tokens)"
    )  # 8 chat-template tokens in warnings[0]
    with pytest.raises(ConfigError, match=r"every prompt .* longer than data\.max_input_seq_length=2 .*row 1, has 11"):
        load_split(cfg, what="data.train", build_prompt=PromptBuilder(tokenizer=tiny_tokenizer), max_input_seq_length=2)
    with pytest.raises(ConfigError, match=r"data\.max_input_seq_length needs the model's tokenizer"):
        load_split(cfg, what="data.train", build_prompt=PromptBuilder(), max_input_seq_length=10)


# ---- the data position ------------------------------------------------------------------------------------------


def _source(tmp_path, n: int, *, shuffle: bool = True, seed: int = 0) -> DatasetSource:
    path = _jsonl(tmp_path / f"d{n}.jsonl", _rows(n))
    config = _config(path, seed=seed)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, shuffle=shuffle))
    source = problem_source(config, None)
    assert isinstance(source, DatasetSource)
    return source


def test_step_problems_do_not_depend_on_earlier_draws(tmp_path):
    walked = _source(tmp_path, 7)
    earlier = [walked.step_problems(step=s, count=3) for s in range(6)]
    fresh = _source(tmp_path, 7)  # a resumed run: step 5 first
    assert fresh.step_problems(step=5, count=3) == earlier[5]
    assert fresh.step_problems(step=2, count=3) == earlier[2]


def test_epochs_wrap_and_reshuffle(tmp_path):
    source = _source(tmp_path, 10)
    everything = {p.prompt for p in source.train.problems}
    epoch0 = source.step_problems(step=0, count=5) + source.step_problems(step=1, count=5)
    epoch1 = source.step_problems(step=2, count=5) + source.step_problems(step=3, count=5)
    assert {p.prompt for p in epoch0} == everything == {p.prompt for p in epoch1}
    assert epoch0 != epoch1
    # A step that spans an epoch boundary, and a count larger than the dataset.
    assert source.step_problems(step=1, count=7) == epoch0[7:] + epoch1[:4]
    assert len(source.step_problems(step=0, count=25)) == 25
    # Another seed, another order.
    assert _source(tmp_path, 10, seed=1).step_problems(step=0, count=10) != epoch0


def test_no_shuffle_is_file_order_every_epoch(tmp_path):
    source = _source(tmp_path, 4, shuffle=False)
    assert [p.answer for p in source.step_problems(step=1, count=3)] == ["4", "1", "2"]


def test_bad_step_or_count(tmp_path):
    source = _source(tmp_path, 4)
    with pytest.raises(ConfigError, match="step must be >= 0"):
        source.step_problems(step=-1, count=1)
    with pytest.raises(ConfigError, match=r"count must be >= 1 \(grpo\.num_prompts_per_step\)"):
        source.step_problems(step=0, count=0)


# ---- validation and the factory ---------------------------------------------------------------------------------


def test_dataset_validation_is_the_validation_file_in_order(tmp_path, caplog):
    train = _jsonl(tmp_path / "t.jsonl", _rows(6))
    val = _jsonl(tmp_path / "v.jsonl", [{"input": f"v{i}", "output": i} for i in range(4)])
    with caplog.at_level(logging.INFO, logger="megatron_fp8.rl.data.problems"):
        source = problem_source(_config(train, validation=val, val_period=2), None)
    assert [p.prompt for p in source.validation_problems(limit=None)] == ["v0", "v1", "v2", "v3"]
    assert [p.prompt for p in source.validation_problems(limit=2)] == ["v0", "v1"]
    assert f"data.train: 6 rows from {train}; data.validation: 4 rows from {val}" in caplog.text


def test_dataset_validation_without_a_validation_file_is_refused(tmp_path):
    train = _jsonl(tmp_path / "t.jsonl", _rows(6))
    for grpo in ({"val_period": 5}, {"val_at_start": True}):
        with pytest.raises(ConfigError, match=r"needs data\.validation\.data_path .*not held out"):
            problem_source(_config(train, **grpo), None)
    source = problem_source(_config(train), None)
    with pytest.raises(ConfigError, match=r"needs data\.validation\.data_path"):
        source.validation_problems(limit=3)


def test_task_source_without_a_dataset(tmp_path):
    source = problem_source(_config(None, task="addition", task_max_digits=2, seed=3), None)
    assert isinstance(source, TaskSource)
    task = get_task("addition", max_digits=2)
    assert source.step_problems(step=4, count=3) == sample_problems(task, seed=3, step=4, count=3)
    val = source.validation_problems(limit=None)
    assert len(val) == TASK_VALIDATION_PROBLEMS
    assert val == source.validation_problems(limit=None)
    assert source.validation_problems(limit=5) == val[:5]
    assert val[:8] != source.step_problems(step=0, count=8)
    with pytest.raises(ConfigError, match=r"data\.validation\.data_path needs data\.train\.data_path"):
        problem_source(_config(None, validation=_jsonl(tmp_path / "v.jsonl", _rows(2))), None)


# ---- the shipped math_tiny dataset ------------------------------------------------------------------------------


def _math_tiny_config(**grpo) -> RunConfig:
    keys = {"input_key": "problem", "output_key": "expected_answer"}
    return RunConfig(
        data=DataConfig(
            train=DatasetConfig(data_path=str(MATH_TINY / "train.jsonl"), **keys),
            validation=DatasetConfig(data_path=str(MATH_TINY / "validation.jsonl"), **keys),
            default=DataDefaultsConfig(prompt_file=str(MATH_TINY / "prompt.txt"), env_name="math"),
        ),
        grpo=GRPOConfig(**grpo),
    )


def test_math_tiny_is_what_make_py_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("math_tiny_make", MATH_TINY / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.write(tmp_path)
    for name in ("train.jsonl", "validation.jsonl", "prompt.txt"):
        assert (tmp_path / name).read_bytes() == (MATH_TINY / name).read_bytes(), (
            f"rerun data/math_tiny/make.py: {name}"
        )


def test_math_tiny_prompts_round_trip_through_the_tiny_tokenizer(tiny_tokenizer):
    source = problem_source(_math_tiny_config(val_period=1), tiny_tokenizer)
    train, val = source.train.problems, source.validation.problems
    assert (len(train), len(val)) == (200, 50)
    assert not {p.prompt for p in train} & {p.prompt for p in val}
    allowed = set(BASE_CHARACTERS)
    for problem in train + val:
        assert problem.answer.isdigit()
        raw = problem.prompt.split("user\n", 1)[1].split("<|im_end|>", 1)[0]
        assert set(raw) <= allowed, f"characters outside the tiny tokenizer's alphabet: {set(raw) - allowed}"
        ids = tiny_tokenizer.encode(problem.prompt, add_special_tokens=False)
        assert tiny_tokenizer.decode(ids) == problem.prompt
    longest = max(len(tiny_tokenizer.encode(p.prompt, add_special_tokens=False)) for p in train + val)
    assert longest < 128
