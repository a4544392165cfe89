"""The calculator task: problems, prompt files, the tool, the verifier, demonstrations."""

from __future__ import annotations

import json
import random

import pytest

from workers.envs import calc
from workers.envs.base import BadLine, RewardError, write_prompt_file
from workers.envs.calc import Problem


def test_problems_are_deterministic_and_distinct():
    a = calc.make_problems(3, 300, "train")
    assert a == calc.make_problems(3, 300, "train")
    assert len({p.prompt for p in a}) == len({p.prompt_id for p in a}) == 300
    assert a != calc.make_problems(4, 300, "train")


def test_splits_are_disjoint_in_ids_and_texts():
    train = calc.make_problems(0, 3000, "train")
    evals = calc.make_problems(0, 500, "eval") + calc.make_problems(7, 500, "eval")
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in evals}
    assert not {p.prompt for p in train} & {p.prompt for p in evals}


def test_bad_split_is_refused():
    with pytest.raises(ValueError):
        calc.make_problems(0, 1, "test")


def test_gold_demonstration_solves_every_problem_with_two_calls():
    for p in calc.make_problems(0, 200, "eval"):
        text = calc.demonstration(p, random.Random(0), noise=0.0)
        assert text.count(calc.CALL_OPEN) == 2
        assert calc.verify(p, text) == 1.0


def test_noisy_demonstrations_are_mostly_wrong_but_well_formed():
    rng = random.Random(1)
    problems = calc.make_problems(0, 200, "train")
    texts = [calc.demonstration(p, rng, noise=1.0) for p in problems]
    wrong = sum(calc.verify(p, t) == 0.0 for p, t in zip(problems, texts))
    assert wrong >= 190
    assert all(t.endswith(calc.ANSWER_CLOSE) for t in texts)


def test_demonstration_tool_results_are_what_the_tool_says():
    rng = random.Random(2)
    for p in calc.make_problems(0, 100, "train"):
        text = calc.demonstration(p, rng, noise=0.5)
        pos = 0
        while (start := text.find(calc.CALL_OPEN, pos)) >= 0:
            expr = calc.parse_tool_call(text[: text.index(calc.CALL_CLOSE, start) + len(calc.CALL_CLOSE)])
            after = text.index(calc.CALL_CLOSE, start) + len(calc.CALL_CLOSE)
            assert text[after:].startswith(calc.run_tool(expr, 1.0).text)
            pos = after


def test_prompt_file_round_trip_and_bad_lines(tmp_path):
    problems = calc.make_problems(0, 5, "train")
    path = tmp_path / "prompts.jsonl"
    write_prompt_file(path, problems)
    with open(path, "a") as f:
        f.write("{not json\n")
        f.write("\n")
        f.write(json.dumps({"prompt_id": "x", "prompt": "Q:1\n"}) + "\n")
        f.write(json.dumps({"prompt_id": "x", "prompt": "Q:1\n", "answer": "3"}) + "\n")
        f.write(json.dumps({"prompt_id": "x", "prompt": "Q:1\n", "answer": True}) + "\n")
        f.write(json.dumps([1, 2]) + "\n")
        f.write(json.dumps({"prompt_id": "y", "prompt": "Q:(1+2)*3\n", "answer": 9}) + "\n")
    items = list(calc.read_prompt_file(path))
    assert items[:5] == problems
    bad = [i for i in items if isinstance(i, BadLine)]
    assert [b.lineno for b in bad] == [6, 8, 9, 10, 11]
    assert "answer" in bad[1].reason and "JSON" in bad[0].reason
    assert items[-1] == Problem("y", "Q:(1+2)*3\n", 9)


@pytest.mark.parametrize(
    "expr,text",
    [
        ("17*23", "<result>391</result>"),
        ("3-50", "<result>-47</result>"),
        ("5--47", "<result>52</result>"),
        ("-47*2", "<result>-94</result>"),
        ("1+2+3", "<result>error</result>"),
        ("17*", "<result>error</result>"),
        ("__import__('os')", "<result>error</result>"),
        ("9" * 13 + "*9", "<result>error</result>"),  # operand over the digit bound
        ("", "<result>error</result>"),
    ],
)
def test_tool_evaluates_one_binary_operation(expr, text):
    res = calc.run_tool(expr, 1.0)
    assert res.text == text and not res.timed_out
    assert 0.0 <= res.latency_s < 1.0


def test_tool_timeout_is_enforced():
    res = calc.run_tool("1+1", 0.05, delay_s=1.0)
    assert res.timed_out and res.text == "<result>error</result>"
    assert res.latency_s < 0.5


def test_tools_run_concurrently():
    results = calc.run_tools(["1+1"] * 8, 2.0, delay_s=0.2)
    assert all(r.text == "<result>2</result>" and not r.timed_out for r in results)
    assert max(r.latency_s for r in results) < 1.0  # serial would take 1.6 s


def test_parse_tool_call():
    assert calc.parse_tool_call("<calc>17*23</calc>") == "17*23"
    assert calc.parse_tool_call("<calc>1</calc><result>1</result><calc>2+2</calc>") == "2+2"
    assert calc.parse_tool_call("17*23</calc>") is None
    assert calc.parse_tool_call("<answer>3</answer>") is None


def test_verify():
    p = Problem("p", "Q:(17*23)+45\n", 436)
    assert calc.verify(p, "<calc>17*23</calc><result>391</result><answer>436</answer>") == 1.0
    assert calc.verify(p, "<answer>435</answer>") == 0.0
    assert calc.verify(p, "<answer>4x6</answer>") == 0.0
    assert calc.verify(p, "<answer>1</answer><answer>436</answer>") == 1.0
    assert calc.verify(p, "436") == 0.0
    assert calc.verify(Problem("n", "Q:(1-5)*1\n", -4), "<answer>-4</answer>") == 1.0


def test_verify_raises_on_its_own_failure():
    with pytest.raises(RewardError):
        calc.verify(Problem("p", "Q:1\n", 1), None)
    with pytest.raises(RewardError):
        calc.verify(Problem("p", "Q:1\n", "1"), "<answer>1</answer>")


def test_tool_span_mask():
    text = "<calc>1+1</calc><result>2</result><answer>2</answer>"
    mask = calc.tool_span_mask(text)
    masked = "".join(c for c, m in zip(text, mask) if m == 0)
    assert masked == "<result>2</result>"
