"""`osd profile`'s split of a decode step: the linear kernels, attention and the rest, on the
fast path (its native attention timed around its calls) and on Hugging Face eager (torch's ops)."""

from __future__ import annotations

import pytest

from bench.profile import step_split
from conftest import tiny_llama
from speculative.runtime import make_runner


@pytest.mark.parametrize("path", ["int4", "none"])
def test_a_step_is_split_between_linear_kernels_attention_and_the_rest(path):
    runner = make_runner(tiny_llama(2, seed=0), path, name="target")
    split = step_split(runner, list(range(3, 40)), [7], repeats=3)
    assert split["matrix_ms"] > 0 and split["attention_ms"] > 0  # both found: op names and the native call
    # the parts lie inside the passes they were taken from (the median step is another run: on a loaded
    # machine a profiled pass of a tiny model's sub-millisecond step may take more than 1.5 times it)
    assert split["matrix_ms"] + split["attention_ms"] <= split["passes_ms"] + 0.02  # each rounded to 0.01 ms
    assert split["rest_ms"] >= 0 and 0 <= split["outside_matrix_share"] < 1
    # the same share as the reported times give, up to their rounding to 0.01 ms (a tiny model's step
    # is a fraction of a millisecond: 0.005 ms of rounding on each moves 1 - matrix / step by up to 0.01 / step)
    rounding = 0.001 + 0.01 / split["step_ms"]
    assert split["outside_matrix_share"] == pytest.approx(1 - split["matrix_ms"] / split["step_ms"], abs=rounding)
    assert runner.cached_length("split") == 0  # its sequence released
    if path == "int4":  # the layers in one native call: its step, and the same kernels' share of it
        assert runner._table is not None and split["one_call_step_ms"] > 0
        assert split["one_call_rest_ms"] >= 0 and 0 <= split["one_call_outside_matrix_share"] < 1
    else:
        assert "one_call_step_ms" not in split
