import json

import pytest

from specd_cli.bench.prompts import PromptFileError, level_prompts, load_sharegpt, load_spec_bench, sample_prompts


@pytest.fixture
def spec_bench_file(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", f"follow-up {i}"]}
            for i, c in enumerate(["writing", "coding", "writing", "writing", "coding", "math"])]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_spec_bench_prompts_are_first_turns_in_file_order(spec_bench_file):
    prompts = load_spec_bench(spec_bench_file)
    assert [(p.prompt_id, p.category, p.text) for p in prompts[:2]] == [("0", "writing", "q0"), ("1", "coding", "q1")]
    assert prompts[0].messages == [{"role": "user", "content": "q0"}]


def test_limit_takes_the_first_n_of_each_category(spec_bench_file):
    prompts = load_spec_bench(spec_bench_file, limit_per_category=2)
    assert [p.prompt_id for p in prompts] == ["0", "1", "2", "4", "5"]


def test_categories_filter_and_unknown_categories_are_an_error(spec_bench_file):
    assert {p.category for p in load_spec_bench(spec_bench_file, categories=["coding"])} == {"coding"}
    with pytest.raises(PromptFileError, match="no prompts in categories poetry"):
        load_spec_bench(spec_bench_file, categories=["coding", "poetry"])


def test_a_missing_file_says_which_path_and_which_flag(tmp_path):
    with pytest.raises(PromptFileError, match=r"not found: .*nope\.jsonl .*--prompts"):
        load_spec_bench(tmp_path / "nope.jsonl")


def test_a_malformed_row_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question_id": 1, "category": "x", "turns": ["a"]}\n{"id": 2}\n')
    with pytest.raises(PromptFileError, match=r"bad\.jsonl:2"):
        load_spec_bench(path)


def test_sharegpt_takes_the_first_human_turn(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "only the model speaks"}]},
    ]))
    prompts = load_sharegpt(path)
    assert [(p.prompt_id, p.category, p.text) for p in prompts] == [("a", "sharegpt", "hi")]


def test_sampled_prompts_are_seeded_and_cycle_through_a_small_set(spec_bench_file):
    pool = load_spec_bench(spec_bench_file)
    drawn = sample_prompts(pool, 14, seed=3)
    assert drawn == sample_prompts(pool, 14, seed=3)
    assert len(drawn) == 14 and set(drawn) == set(pool)
    assert drawn[:6] == drawn[6:12]


def test_each_load_level_gets_prompts_no_earlier_level_had_while_the_set_has_enough(spec_bench_file):
    pool = load_spec_bench(spec_bench_file)  # 6 prompts
    first, second = level_prompts(pool, [2, 4], seed=3)
    assert (len(first), len(second)) == (2, 4) and not set(first) & set(second)
    assert level_prompts(pool, [2, 4], seed=3) == [first, second]
    # a set too small for every level: the later levels repeat prompts
    assert sum(map(len, level_prompts(pool, [4, 4], seed=3))) == 8
