"""megatron-fp8's sequence bin packing against NeMo-RL's own packers (its code, run unchanged:
``data/nemo_rl/README.md``): the same bins, in the same order, on many random length lists."""

from __future__ import annotations

import random
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron.bins import PACKING_ALGORITHMS, pack_bins

SOURCE = Path(__file__).parents[1] / "rl" / "algorithm" / "data" / "nemo_rl" / "packing_algorithms.py.txt"
DETERMINISTIC = ("concatenative", "first_fit_decreasing", "modified_first_fit_decreasing")


@pytest.fixture(scope="module")
def nemo_rl() -> types.ModuleType:
    """NeMo-RL's ``nemo_rl.data.packing.algorithms``; it imports only the standard library."""
    mod = types.ModuleType("nemo_rl.data.packing.algorithms")
    exec(compile(SOURCE.read_text(), str(SOURCE), "exec"), mod.__dict__)  # NeMo-RL's code, as it is
    return mod


@pytest.fixture
def global_random() -> Iterator[None]:
    """NeMo-RL's first_fit_shuffle draws from the global random state: leave it as found."""
    state = random.getstate()
    yield
    random.setstate(state)


def _cases(seed: int, *, zeros: bool = False) -> Iterator[tuple[list[int], int]]:
    """(lengths, capacity) pairs: ties, lengths at capacity and at the MFFD class bounds, narrow and wide spreads,
    RL-like long tails; capacities with and without factors 2, 3 and 6."""
    rng = random.Random(seed)
    low = 0 if zeros else 1
    for _ in range(60):
        cap = rng.choice([1, 2, 5, 6, 7, 12, 13, 30, 100, 101, 1000])
        n = rng.randint(0, 40)
        bounds = [cap, cap // 2, cap // 2 + 1, cap // 3, cap // 3 + 1, cap // 6, cap // 6 + 1, cap // 4, 1]
        pool = [b for b in bounds if low <= b <= cap]
        yield [rng.choice(pool) for _ in range(n)], cap  # many ties, class boundaries
        yield [rng.randint(low, cap) for _ in range(n)], cap  # wide spread
        yield [rng.randint(max(low, cap - 2), cap) for _ in range(n)], cap  # near / at capacity
        top = max(low, cap // 8)
        yield [rng.randint(low, top) for _ in range(n)], cap  # tiny only
    for cap in (512, 1024, 2048):
        for _ in range(20):
            n = rng.randint(1, 256)
            yield [min(256, 16 + int(rng.expovariate(1 / 40))) for _ in range(n)], cap  # long-tailed RL lengths
            yield [rng.choice([16, 64, 128, 256]) for _ in range(n)], cap


def _assert_valid(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b and sum(lengths[i] for i in b) <= capacity for b in bins)


def test_algorithm_names_match_nemo_rl(nemo_rl: types.ModuleType) -> None:
    assert set(PACKING_ALGORITHMS) == {a.value for a in nemo_rl.PackingAlgorithm}


@pytest.mark.parametrize("algorithm", DETERMINISTIC)
def test_same_bins_as_nemo_rl(nemo_rl: types.ModuleType, algorithm: str) -> None:
    zeros = algorithm != "modified_first_fit_decreasing"  # NeMo-RL's MFFD rejects zero lengths
    checked = 0
    for lengths, cap in _cases(7 + DETERMINISTIC.index(algorithm), zeros=zeros):
        expected = nemo_rl.get_packer(algorithm, cap).pack(lengths)
        ours = pack_bins(lengths, capacity=cap, algorithm=algorithm)
        assert ours == expected, (algorithm, cap, lengths)
        _assert_valid(ours, lengths, cap)
        checked += 1
    assert checked > 250


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_same_extra_bins_as_nemo_rl(nemo_rl: types.ModuleType, algorithm: str, global_random: None) -> None:
    rng = random.Random(3)
    for case, (lengths, cap) in enumerate(_cases(11)):
        min_count, multiple = rng.choice([None, 0, 1, 2, 3, 8]), rng.choice([None, 1, 2, 4, 8])
        packer = nemo_rl.get_packer(algorithm, cap, min_bin_count=min_count, bin_count_multiple=multiple)
        random.seed(case)
        try:
            expected = packer.pack(lengths)
        except ValueError:  # too few sequences for the bins asked for
            with pytest.raises(ConfigError, match="micro-batches"):
                pack_bins(
                    lengths,
                    capacity=cap,
                    algorithm=algorithm,
                    seed=case,
                    min_bin_count=min_count,
                    bin_count_multiple=multiple,
                )
            continue
        ours = pack_bins(
            lengths, capacity=cap, algorithm=algorithm, seed=case, min_bin_count=min_count, bin_count_multiple=multiple
        )
        assert ours == expected, (algorithm, cap, min_count, multiple, lengths)
        _assert_valid(ours, lengths, cap)
        assert len(ours) >= (min_count or 0) and len(ours) % (multiple or 1) == 0


def test_first_fit_shuffle_same_bins_for_same_seed(nemo_rl: types.ModuleType, global_random: None) -> None:
    for case, (lengths, cap) in enumerate(_cases(5, zeros=True)):
        random.seed(case)
        expected = nemo_rl.get_packer("first_fit_shuffle", cap).pack(lengths)
        assert pack_bins(lengths, capacity=cap, algorithm="first_fit_shuffle", seed=case) == expected
        random.seed(case)  # seed=None: the global state, as NeMo-RL
        assert pack_bins(lengths, capacity=cap, algorithm="first_fit_shuffle") == expected
        _assert_valid(expected, lengths, cap)


def test_first_fit_shuffle_seed_is_private(global_random: None) -> None:
    random.seed(0)
    before = random.random()
    random.seed(0)
    pack_bins([3, 1, 2, 2, 5], capacity=5, algorithm="first_fit_shuffle", seed=4)
    assert random.random() == before


def test_mffd_is_the_default_and_names_are_case_insensitive(nemo_rl: types.ModuleType) -> None:
    lengths = [7, 3, 3, 2, 9, 1, 4, 6, 5, 5]
    expected = nemo_rl.get_packer("MODIFIED_FIRST_FIT_DECREASING", 10).pack(lengths)
    assert pack_bins(lengths, capacity=10) == expected
    assert pack_bins(lengths, capacity=10, algorithm="Modified_First_Fit_Decreasing") == expected


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_empty_input(algorithm: str) -> None:
    assert pack_bins([], capacity=8, algorithm=algorithm) == []


def test_unknown_algorithm_names_key_and_choices() -> None:
    with pytest.raises(ConfigError, match=r"policy\.sequence_packing\.algorithm") as err:
        pack_bins([1, 2], capacity=8, algorithm="best_fit")
    assert "'best_fit'" in str(err.value)
    assert all(name in str(err.value) for name in PACKING_ALGORITHMS)


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_sequence_over_capacity_names_index_length_and_key(nemo_rl: types.ModuleType, algorithm: str) -> None:
    lengths = [100, 300, 600, 50]
    with pytest.raises(ValueError):  # NeMo-RL rejects it too
        nemo_rl.get_packer(algorithm, 512).pack(lengths)
    with pytest.raises(ConfigError) as err:
        pack_bins(lengths, capacity=512, algorithm=algorithm)
    message = str(err.value)
    assert "sequence 2" in message and "600" in message and "512" in message
    assert "policy.sequence_packing.train_mb_tokens" in message and "logprob_mb_tokens" in message
    key = "policy.sequence_packing.logprob_mb_tokens"
    with pytest.raises(ConfigError, match=rf"raise {key} to at least 600"):
        pack_bins(lengths, capacity=512, algorithm=algorithm, what=key)


@pytest.mark.parametrize("capacity", [0, -4])
def test_capacity_below_one(capacity: int) -> None:
    with pytest.raises(ConfigError, match="at least 1"):
        pack_bins([1], capacity=capacity)


def test_bad_lengths_and_bin_constraints() -> None:
    with pytest.raises(ValueError, match="sequence 1"):
        pack_bins([3, -1], capacity=8, algorithm="concatenative")
    with pytest.raises(ValueError, match="sequence 0"):
        pack_bins([0, 4], capacity=8)  # MFFD: positive lengths, as NeMo-RL
    assert pack_bins([0, 4], capacity=8, algorithm="first_fit_decreasing") == [[1, 0]]
    with pytest.raises(ConfigError, match="min_bin_count"):
        pack_bins([1], capacity=8, min_bin_count=-1)
    with pytest.raises(ConfigError, match="bin_count_multiple"):
        pack_bins([1], capacity=8, bin_count_multiple=0)
    with pytest.raises(ConfigError, match="only 2 sequences"):
        pack_bins([1, 1], capacity=8, min_bin_count=3)
