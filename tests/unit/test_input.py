"""Strict input: every bad request or setting gets a clear RequestError / ValidationError (library)
or one error line and exit status 2 (CLI), never a traceback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from config import GREEDY_BELOW, KPolicyConfig, ModelConfig, SamplingParams, ValidationError
from osd.cli import main as osd_main
from speculative import RequestError
from speculative.models import ModelLoadError, check_device
from speculative.sampling import warp_logits


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(None)


@pytest.mark.parametrize("prompt, says", [
    ("abc\ud800def", "not valid Unicode"),  # a lone surrogate
    (b"abc\xff\xfe", "not valid UTF-8"),
    ("   ", "empty"),
    ([1.0, 2], "must be integers"),
    ([True, 3], "must be integers"),
    ([3, 500], "out of range"),
    ([-1], "out of range"),
    ([], "empty"),
    (12, "text or a list"),
])
def test_bad_prompts_are_request_errors(engine, prompt, says):
    with pytest.raises(RequestError, match=says):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert not engine.requests


def test_good_prompts_in_every_form(engine):
    ids = engine.encode("abc")
    for prompt in ("abc", b"abc", ids, tuple(ids), list(np.array(ids, dtype=np.int64))):
        gen = engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        assert gen.prompt_tokens == len(ids) and len(gen.token_ids) == 3


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.1),
    ("top_p", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5),
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True), ("seed", 1.5), ("seed", 2**64),
])
def test_bad_sampling_params_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("temperature", [1e-40, 1e-20, GREEDY_BELOW / 2])
def test_tiny_temperature_is_greedy(engine, temperature, prompts):
    """Below GREEDY_BELOW the request is greedy: no overflow, and the greedy tokens."""
    params = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
    assert params.greedy
    logits = torch.tensor([[30.0, 29.0, -5.0]])
    assert torch.equal(warp_logits(logits, params), torch.tensor([[1.0, 0.0, 0.0]]))
    greedy = engine.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    assert engine.generate(prompts[0], params).token_ids == greedy


def test_temperature_just_above_the_threshold_samples_without_overflow():
    params = SamplingParams(temperature=GREEDY_BELOW * 2)
    assert not params.greedy
    probs = warp_logits(torch.tensor([[30.0, 29.9999, -5.0]]), params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-6


def test_bad_settings_are_refused():
    with pytest.raises(ValidationError, match="unknown device 'gpu'"):
        ModelConfig(device="gpu")
    assert ModelConfig(device="cuda:1").device == "cuda:1"  # a valid name; availability is checked at load
    with pytest.raises(ValidationError, match=r"fixed_k \(7\) must be <= k.k_max \(6\)"):
        KPolicyConfig(fixed_k=7)
    assert KPolicyConfig(fixed_k=6).fixed_k == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has the device")
def test_missing_device_is_a_load_error():
    with pytest.raises(ModelLoadError, match="not available"):
        check_device("cuda")
    check_device("cpu")


@pytest.mark.parametrize("argv, says", [
    (["generate", "abc\udcff"], "not valid Unicode"),  # undecodable bytes in a command line arrive so
    (["generate", "  "], "prompt is empty"),
    (["generate", "hi", "--temperature", "nan"], "temperature: Input should be a finite number"),
    (["generate", "hi", "--top-p", "inf"], "top_p"),
    (["generate", "hi", "--device", "gpu"], "unknown device 'gpu'"),
    (["generate", "hi", "--fixed-k", "9"], "fixed_k (9) must be <= k.k_max (6)"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["serve", "--config", "/nonexistent/serve.yaml"], "No such file or directory: /nonexistent/serve.yaml"),
    (["serve", "--config", "/"], "Is a directory: /"),
    (["serve", "--config", "tests/unit/test_input.py"], "is not valid YAML"),
    (["serve", "--config", "bench/configs/shift_controller.yaml"], "no application"),  # YAML, not a Serve config
])
def test_cli_reports_bad_input_in_one_line(argv, says, capsys):
    """Refused before any model is loaded: one line on stderr, exit status 2."""
    assert osd_main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_token_id_bounds(engine, V):
    for ok in ([0], [V - 1], [0, V - 1]):
        assert engine.generate(ok, SamplingParams(max_tokens=1, ignore_eos=True)).prompt_tokens == len(ok)
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request([V], SamplingParams(max_tokens=1))


def test_context_window_boundary(engine):
    limit = engine.max_positions
    prompt = engine.encode("abcdef")
    rid = engine.add_request(prompt, SamplingParams(max_tokens=limit - len(prompt)))  # exactly the window
    engine.release(rid)
    with pytest.raises(RequestError, match="exceeds the model's context"):
        engine.add_request(prompt, SamplingParams(max_tokens=limit - len(prompt) + 1))
