"""Issue 9, the command line: every bad file, spec, flag or saved schedule exits 2 (or 1 for an invalid saved
schedule) with one line naming the file, the line and the field -- never a traceback, a hang or an endless read.

Most cases run ``slime_ext.cli.main`` in this process (fast); :func:`test_real_processes` runs a few through
``python -m slime_ext.cli`` to cover the process path (exit code, stderr, nothing on stdout).

Classes: JSONL readers and decoders, ``.npy``, YAML configs, ``--synthetic`` specs, flags, ``--from-json``.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_ext.cli import inputs, main
from slime_ext.cli import plan as plan_cmd
from tests.conftest import examples, json_paths

REPO = Path(__file__).resolve().parents[2]
GBS = ("--global-batch-size", 1)
#: Hypothesis examples that write files: the tmp_path fixture is shared across examples, which is fine here
SHARED_TMP = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def cli(*args, cwd=None) -> SimpleNamespace:
    """``main()`` in this process; argparse's own errors (SystemExit) count as their exit code."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd or old)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:
                rc = e.code
    finally:
        os.chdir(old)
    return SimpleNamespace(rc=rc, stdout=out.getvalue(), stderr=err.getvalue())


def refused(res, *fragments: str) -> None:
    """Exit 2, one line ``slime-ext plan: error: ...`` holding every fragment, nothing on stdout."""
    assert res.rc == 2, f"rc={res.rc}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.stderr.startswith("slime-ext plan: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    for f in fragments:
        assert f in res.stderr, f"{f!r} not in {res.stderr!r}"


def clean_exit(res) -> None:
    """For fuzzed inputs: 0 or 2 (argparse's usage + error counts), never a traceback."""
    assert res.rc in (0, 2), f"rc={res.rc}\n{res.stdout}\n{res.stderr}"
    assert "Traceback" not in res.stderr + res.stdout
    if res.rc == 2:
        assert "error:" in res.stderr and res.stdout == "", res.stderr


# ---------------------------------------------------------------------------------------------------- JSONL
def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


GOOD = b'{"total_length": 10}\n'
JSONL_CASES = [
    ("corrupt.gz", _gz(GOOD)[:10] + b"\xff" * 40, ["corrupt.gz:1: cannot read", "invalid block type",
                                                   "is it a complete gzip file?"]),
    ("cut.gz", _gz(GOOD * 50)[:25], ["cut.gz:1: cannot read", "is it a complete gzip file?"]),
    ("not.gz", GOOD, ["not.gz:1: cannot read: Not a gzipped file"]),
    ("trailing.gz", _gz(GOOD) + b"junk", ["trailing.gz:2: cannot read"]),
    ("deep.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", ["deep.jsonl:1: JSON nested too deeply"]),
    ("deep_obj.jsonl", GOOD + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"\n", ["deep_obj.jsonl:2: JSON nested"]),
    ("digits.jsonl", b'{"total_length": ' + b"9" * 5000 + b"}\n", ["digits.jsonl:1: not readable JSON",
                                                                    "4300 digits"]),
    ("nan.jsonl", b'{"total_length": NaN}\n', ["nan.jsonl:1: field 'total_length' is NaN, not an integer"]),
    ("inf.jsonl", b'{"total_length": 10, "loss_tokens": 1}\n{"total_length": 10, "loss_tokens": -Infinity}\n',
     ["inf.jsonl:2: field 'loss_tokens' is -Infinity"]),
    ("latin1.jsonl", GOOD + b'{"total_length": 10, "n\xe9": 1}\n', ["latin1.jsonl:2: not UTF-8 text"]),
    ("big.jsonl", b'{"total_length": 9223372036854775808}\n',
     ["big.jsonl:1: field 'total_length' is 9223372036854775808, above the limit MAX_TOKENS = 2**32"]),
    ("big_loss.jsonl", b'{"total_length": 10, "loss_tokens": 18446744073709551616}\n',
     ["big_loss.jsonl:1: field 'loss_tokens' is 18446744073709551616, above the limit MAX_TOKENS"]),
    ("big_id.jsonl", b'{"total_length": 10, "rollout_id": 9223372036854775808}\n',
     ["big_id.jsonl:1: field 'rollout_id' is 9223372036854775808, outside int64"]),
    ("neg_id.jsonl", b'{"total_length": 10, "rollout_id": true}\n', ["neg_id.jsonl:1: field 'rollout_id' is true"]),
    ("tokens.jsonl", b'{"tokens": 4294967297}\n', ["tokens.jsonl:1: field 'tokens' is 4294967297, above the limit"]),
    ("nul.jsonl", b"\x00" * 1000 + b"\n", ["nul.jsonl:1: not valid JSON"]),
    ("bom16.jsonl", "\ufeff{}\n".encode("utf-16"), ["bom16.jsonl:1: not"]),
]


@pytest.mark.parametrize("name, data, fragments", JSONL_CASES, ids=[c[0] for c in JSONL_CASES])
def test_jsonl_reader_and_decoder_failures_name_the_file_and_line(name, data, fragments, tmp_path):
    (tmp_path / name).write_bytes(data)
    refused(cli("plan", name, *GBS, cwd=tmp_path), *fragments)


def test_a_line_is_read_to_a_bound_and_samples_are_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "MAX_LINE_BYTES", 1000)
    (tmp_path / "long.jsonl").write_bytes(GOOD + b" " * 5000 + GOOD)
    refused(cli("plan", "long.jsonl", *GBS, cwd=tmp_path), "long.jsonl:2: the line is longer than",
            "MAX_LINE_BYTES")
    (tmp_path / "ok.jsonl").write_bytes(b'{"total_length": 10}' + b" " * 979 + b"\n")  # 1000 bytes + newline
    assert cli("plan", "ok.jsonl", *GBS, "-q", cwd=tmp_path).rc == 0
    monkeypatch.setattr(inputs, "MAX_SAMPLES", 3)
    (tmp_path / "many.jsonl").write_bytes(GOOD * 4)
    refused(cli("plan", "many.jsonl", *GBS, cwd=tmp_path), "many.jsonl:4: more than 3 samples")


def test_unreadable_paths(tmp_path):
    refused(cli("plan", tmp_path, *GBS), f"cannot read {tmp_path}")  # a directory
    refused(cli("plan", "missing.jsonl", *GBS, cwd=tmp_path), "cannot read missing.jsonl: No such file")


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=4)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)
LINE = st.one_of(
    st.fixed_dictionaries({"total_length": JSON_VALUES | st.integers(1, 100)},
                          optional={"rollout_id": JSON_VALUES, "loss_tokens": JSON_VALUES,
                                    "tokens": JSON_VALUES}).map(lambda d: json.dumps(d).encode()),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=30),
)


@settings(max_examples=examples(150), parent=SHARED_TMP)
@given(st.lists(LINE, min_size=1, max_size=4), st.booleans())
def test_any_jsonl_content_plans_or_exits_2_naming_the_line(tmp_path, lines, gz):
    data = b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n"
    name = "f.jsonl.gz" if gz else "f.jsonl"
    (tmp_path / name).write_bytes(_gz(data) if gz else data)
    res = cli("plan", name, "--use-dynamic-global-batch-size", "-q", cwd=tmp_path)
    clean_exit(res)
    if res.rc == 2:
        assert f"{name}:" in res.stderr, res.stderr  # the file, and its line where there is one


# ---------------------------------------------------------------------------------------------------- .npy
def _npy_header_claiming(shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.arange(4, dtype=np.int64))
    data = buf.getvalue()
    return data.replace(b"(4,)", repr(shape).encode().ljust(4))[:-16]  # and fewer data bytes than even 4 entries


NPY_CASES = [
    ("uint64", lambda p: np.save(p, np.array([10, 2**63 + 5], dtype=np.uint64)),
     "entry 1 is 9223372036854775813; every length must be <= MAX_TOKENS"),
    ("huge", lambda p: np.save(p, np.array([10, 2**40], dtype=np.int64)), "entry 1 is 1099511627776"),
    ("object", lambda p: np.save(p, np.array([10, 20], dtype=object), allow_pickle=True),
     "not a plain .npy array"),
    ("garbage", lambda p: Path(p).write_bytes(b"\x93NUMPY garbage"), "not a plain .npy array"),
    ("empty_file", lambda p: Path(p).write_bytes(b""), "not a plain .npy array"),
    ("claims_more", lambda p: Path(p).write_bytes(_npy_header_claiming((10**12,))), "not a plain .npy array"),
    ("bool", lambda p: np.save(p, np.array([True, False])), "array of dtype bool, not integers"),
    ("scalar", lambda p: np.save(p, np.array(5)), "array of shape ()"),
]


@pytest.mark.parametrize("name, write, fragment", NPY_CASES, ids=[c[0] for c in NPY_CASES])
def test_npy_failures(name, write, fragment, tmp_path):
    write(tmp_path / "f.npy")
    refused(cli("plan", "f.npy", *GBS, cwd=tmp_path), "f.npy", fragment)


def test_npy_of_any_integer_dtype_plans_like_the_list(tmp_path):
    for dtype in (np.int8, np.uint16, np.int32, np.uint64, ">i8"):
        np.save(tmp_path / "f.npy", np.array([10, 20, 30, 40], dtype=dtype))
        np.save(tmp_path / "g.npy", np.array([10, 20, 30, 40], dtype=np.int64))
        a = cli("plan", "f.npy", *GBS, "-q", cwd=tmp_path)
        b = cli("plan", "g.npy", *GBS, "-q", cwd=tmp_path)
        assert a.rc == b.rc == 0 and a.stdout.replace("f.npy", "g.npy") == b.stdout


# ---------------------------------------------------------------------------------------------------- YAML
YAML_CASES = [
    ("latin1", b"dp_size: 1\n# caf\xe9\n", "c.yaml: not UTF-8 text"),
    ("deep", b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "c.yaml: YAML nested too deeply"),
    ("list", b"- 1\n- 2\n", "the config is a YAML list"),
    ("nul", b"\x00" * 100, "c.yaml: not valid YAML (unacceptable character #x0000"),
    ("float_dp", b"dp_size: 1.0e+30\n", "key 'dp_size' is 1e+30; it must be an integer"),
    ("str_dp", b"dp_size: 1.0e30\n", "key 'dp_size' is '1.0e30'; it must be an integer"),
    ("huge_dp", b"dp_size: 1000000000000000000000\n", "c.yaml: dp_size is 1000000000000000000000, above the limit"),
    ("nan_tflops", b"tflops: .nan\n", "c.yaml: tflops is nan; it must be a finite number > 0"),
    ("inf_tflops", b"tflops: .inf\n", "tflops is inf; it must be a finite number"),
    ("str_bool", b"use_dynamic_batch_size: 'False'\n", "c.yaml: use_dynamic_batch_size must be a bool (True or "
                                                        "False), got 'False' (str)"),
    ("moe_freq0", b"hidden_size: 8\nnum_layers: 2\nnum_attention_heads: 2\nnum_experts: 4\nmoe_layer_freq: 0\n",
     "CostModel.moe_layer_freq must be a positive integer, got 0"),
    ("neg_vocab", b"hidden_size: 8\nnum_layers: 2\nnum_attention_heads: 2\nvocab_size: -5\n",
     "CostModel.vocab_size must be an integer >= 0, got -5"),
    ("alias_loop", b"moe_layer_freq: &a [*a]\n", "key 'moe_layer_freq'"),
    ("bad_yaml", b"a: [1, 2\n", "c.yaml:2: not valid YAML"),
]


@pytest.mark.parametrize("name, text, fragment", YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_config_failures_name_the_file_and_key(name, text, fragment, tmp_path):
    (tmp_path / "c.yaml").write_bytes(text)
    refused(cli("plan", "--synthetic", "lognormal:n=8", *GBS, "--config", "c.yaml", cwd=tmp_path), fragment)


# ---------------------------------------------------------------------------------------------------- --synthetic
SPEC_CASES = [
    ("lognormal:seed=-1", "seed=-1 is outside 0.."),
    ("lognormal:seed=18446744073709551616", "seed=18446744073709551616 is outside"),
    ("lognormal:prompt=0-100000000000000000000", "prompt=0-100000000000000000000: HI is above"),
    ("lognormal:prompt=5-4294967296", "HI is above 4,294,967,295"),
    ("lognormal:prompt=-5-10", "prompt='-5-10' is not LO-HI integers"),
    ("lognormal:prompt=9-3", "prompt=9-3 must be 0 <= LO <= HI"),
    ("lognormal:mu=nan", "mu=nan must be a finite number"),
    ("lognormal:sigma=inf", "sigma=inf must be a finite number"),
    ("lognormal:sigma=-1", "sigma=-1.0 must be >= 0"),
    ("lognormal:mu=1e400", "mu=inf must be a finite number"),
    ("lognormal:mu=1000,cap=0,n=8", "the lognormal responses reach infinity tokens, above the limit MAX_TOKENS"),
    ("lognormal:mu=25,cap=0,n=8", "lower mu, sigma or set cap=N"),
    ("pareto:alpha=0", "alpha=0.0 and scale=300.0 must both be > 0"),
    ("pareto:alpha=1e-300,cap=0,n=8", "the pareto responses reach infinity tokens"),
    ("pareto:scale=nan", "scale=nan must be a finite number"),
    ("lognormal:n=10000000000000", "n=10000000000000 is outside 1..MAX_SAMPLES = 2**27"),
    ("lognormal:n=0", "n=0 is outside 1.."),
    ("lognormal:n=1e3", "n='1e3' is not int"),
    ("lognormal:n=" + "9" * 5000, "is not int"),
    ("lognormal:cap=-1", "cap=-1 is outside 0.."),
    ("lognormal:cap=99999999999", "cap=99999999999 is outside 0.."),
    ("lognormal:samples_per_rollout=0", "samples_per_rollout=0 is outside 1.."),
    ("lognormal:n=3,n=4", "key 'n' given twice"),
    ("lognormal:bogus=1", "unknown key 'bogus' for lognormal"),
    ("gamma:n=3", "unknown distribution 'gamma'"),
]


@pytest.mark.parametrize("spec, fragment", SPEC_CASES, ids=[c[0][:40] for c in SPEC_CASES])
def test_synthetic_spec_failures_name_the_key(spec, fragment):
    refused(cli("plan", "--synthetic", spec, *GBS), f"--synthetic '{spec[:30]}", fragment)


def test_synthetic_draws_are_unchanged_for_valid_specs():
    """The benchmark's rl-1k input (bench/workloads.py) is still lognormal:n=1024,seed=1."""
    from bench.workloads import make_lengths

    s = inputs.synthetic("lognormal:n=1024,seed=1")
    assert s.total_lengths.tolist() == make_lengths("rl", 1024, 1).tolist()
    p = inputs.synthetic("pareto:n=300,alpha=0.3,seed=2")  # heavy: many capped at 16000
    assert p.loss_tokens.max() == 16000 and p.total_lengths.dtype == np.int64


SPEC_VALUE = st.one_of(st.integers(-3, 40).map(str), st.integers(-(2**70), 2**70).map(str),
                       st.floats(allow_nan=True, allow_infinity=True).map(str), st.text(max_size=5),
                       st.tuples(st.integers(-5, 10**12), st.integers(-5, 10**12)).map(lambda t: f"{t[0]}-{t[1]}"))
SPEC_KEYS = ["n", "prompt", "cap", "seed", "samples_per_rollout", "mu", "sigma", "alpha", "scale", "bogus"]


@settings(max_examples=examples(200))
@given(st.sampled_from(["lognormal", "pareto", "x"]), st.dictionaries(st.sampled_from(SPEC_KEYS), SPEC_VALUE,
                                                                        max_size=4),
       st.integers(1, 64))
def test_any_synthetic_spec_plans_or_exits_2_naming_it(kind, params, n):
    params.setdefault("n", str(n))  # a small rollout unless n itself is drawn
    spec = kind + ":" + ",".join(f"{k}={v}" for k, v in params.items())
    res = cli("plan", "--synthetic", spec, "--use-dynamic-global-batch-size", "-q")
    clean_exit(res)
    if res.rc == 2:
        assert "--synthetic" in res.stderr, res.stderr


# ---------------------------------------------------------------------------------------------------- flags
FLAG_CASES = [
    (["--tflops", "nan"], "--tflops is nan; it must be a finite number > 0"),
    (["--tflops", "inf"], "--tflops is inf"),
    (["--tflops", "-1"], "--tflops is -1.0"),
    (["--tflops", "1e-300"], "--tflops is 1e-300; it must be in [1e-06, 1e+06]"),
    (["--tflops", "1e308"], "--tflops is 1e+308; it must be in"),
    (["--dp-size", str(10**30)], "--dp-size is 1000000000000000000000000000000, above the limit MAX_PARALLEL_SIZE"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size is 0; it must be a positive integer"),
    (["--num-gpus", str(2**40)], "--num-gpus is 1099511627776, above the limit"),
    (["--max-tokens-per-gpu", str(2**62), "--use-dynamic-batch-size"], "max_tokens_per_gpu = 4611686018427387904 "
                                                                        "is above the limit MAX_TOKENS"),
    (["--global-batch-size", str(10**15)], "global_batch_size = 1000000000000000 is above the limit MAX_SAMPLES"),
    (["--micro-batch-size", "-3"], "micro_batch_size must be a positive integer, got -3"),
    (["--hidden-size", str(10**200), "--num-layers", "2", "--num-attention-heads", "2"],
     "CostModel.hidden_size = an integer of 665 bits"),
    (["--hidden-size", "8", "--num-layers", "2", "--num-attention-heads", "2", "--kv-channels", "-1"],
     "CostModel.kv_channels must be a positive integer, got -1"),
    (["--hidden-size", "8", "--num-layers", "2", "--num-attention-heads", "2", "--num-experts", "4",
      "--moe-layer-freq", "0"], "CostModel.moe_layer_freq must be a positive integer, got 0"),
    (["--hidden-size", "8", "--num-layers", "2", "--num-attention-heads", "2", "--num-experts", "4",
      "--moe-layer-freq", "[1,5]"], "CostModel.moe_layer_freq[1] = 5"),
    (["--vpp-size", "2"], "needs --microbatch-group-size-per-vp-stage"),
]


@pytest.mark.parametrize("flags, fragment", FLAG_CASES, ids=[" ".join(c[0])[:40] for c in FLAG_CASES])
def test_flag_failures_name_the_flag(flags, fragment):
    args = list(flags) if "--global-batch-size" in flags else [*flags, *GBS]
    refused(cli("plan", "--synthetic", "lognormal:n=8", *args), fragment)


def test_argparse_refusals_exit_2_without_a_traceback():
    for flags in (["--dp-size", "abc"], ["--moe-layer-freq", "[" * 5000 + "]" * 5000], ["--tflops", "x"],
                  ["--moe-layer-freq", "9" * 5000]):
        res = cli("plan", "--synthetic", "lognormal:n=8", *GBS, *flags)
        assert res.rc == 2 and "error: argument" in res.stderr and "Traceback" not in res.stderr, res.stderr


INT_FLAGS = ["--dp-size", "--cp-size", "--vpp-size", "--microbatch-group-size-per-vp-stage", "--global-batch-size",
             "--micro-batch-size", "--max-tokens-per-gpu", "--tensor-model-parallel-size", "--num-gpus",
             "--hidden-size", "--num-layers", "--num-attention-heads", "--vocab-size", "--num-experts",
             "--moe-router-topk", "--kv-channels", "--moe-layer-freq", "--tflops"]
FLAG_TEXT = st.one_of(st.integers(-3, 70).map(str), st.integers(-(2**80), 2**80).map(str),
                      st.floats(allow_nan=True, allow_infinity=True).map(str), st.text(max_size=4),
                      st.lists(st.integers(-2, 3), max_size=4).map(json.dumps))


@settings(max_examples=examples(200))
@given(st.dictionaries(st.sampled_from(INT_FLAGS), FLAG_TEXT, max_size=4), st.booleans())
def test_any_flag_values_plan_or_exit_2(flags, dynamic):
    argv = [x for k, v in flags.items() for x in (k, v)]
    if "--global-batch-size" not in flags:
        argv += ["--use-dynamic-global-batch-size"]
    if dynamic:
        argv += ["--use-dynamic-batch-size"] + ([] if "--max-tokens-per-gpu" in flags else
                                                ["--max-tokens-per-gpu", "4096"])
    if any(k in flags for k in ("--hidden-size", "--num-layers", "--num-attention-heads")):
        for k, v in (("--hidden-size", "64"), ("--num-layers", "2"), ("--num-attention-heads", "4")):
            if k not in flags:
                argv += [k, v]
    clean_exit(cli("plan", "--synthetic", "lognormal:n=16", "-q", *argv))


# ---------------------------------------------------------------------------------------------------- --from-json
@pytest.fixture(scope="module")
def saved_json(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    res = cli("plan", "--synthetic", "lognormal:n=16,samples_per_rollout=2", "--global-batch-size", 4,
              "--use-dynamic-batch-size", "--max-tokens-per-gpu", 4096, "--dp-size", 2, "--hidden-size", 64,
              "--num-layers", 2, "--num-attention-heads", 4, "--json", d / "s.json", "-q")
    assert res.rc == 0, res.stderr
    return json.loads((d / "s.json").read_text())


def _with_stats_patched(d: dict) -> dict:
    """What the issue did: edit an input, then patch the stats to match, so that only the input is wrong."""
    out = copy.deepcopy(d)
    lengths = out["total_lengths"]
    for s, st_ in enumerate(out["stats"]):
        members = out["step_samples"][s]
        try:
            st_["total_tokens"] = sum(lengths[g] for g in members)
        except TypeError:
            pass
    return out


@pytest.mark.parametrize("field, value, fragment", [
    ("total_lengths", 0, "total_lengths[0] = 0 is below 1"),
    ("total_lengths", -100, "total_lengths[0] = -100 is below 1"),
    ("total_lengths", 100.5, "total_lengths[0] = 100.5 is not an integer"),
    ("total_lengths", True, "total_lengths[0] = True is not an integer"),
    ("loss_tokens", 10**9, "loss_tokens[0] = 1000000000 exceeds total_lengths[0]"),
    ("loss_tokens", -1, "loss_tokens[0] = -1 is below 0"),
    ("rollout_ids", "0", "rollout_ids[0] = '0' is not an integer"),
])
def test_from_json_refuses_bad_recorded_inputs(saved_json, field, value, fragment, tmp_path):
    d = copy.deepcopy(saved_json)
    d[field][0] = value
    (tmp_path / "t.json").write_text(json.dumps(_with_stats_patched(d)))
    res = cli("plan", "--from-json", tmp_path / "t.json")
    assert res.rc == 1 and res.stdout.startswith("INVALID:") and fragment in res.stdout, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.parametrize("data, fragment", [
    (b"[" * 100_000 + b"]" * 100_000, "s.json: does not start with a JSON object"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "s.json: JSON nested too deeply"),
    (b'{"schema_version": ' + b"1" * 5000 + b"}", "s.json: not readable JSON"),
    (b'{"x": "caf\xe9"}', "s.json: not UTF-8 text"),
    (b"\x00" * 10_000, "s.json: does not start with a JSON object"),
    (b"", "s.json: empty file"),
])
def test_from_json_reader_failures_exit_2(data, fragment, tmp_path):
    (tmp_path / "s.json").write_bytes(data)
    refused(cli("plan", "--from-json", "s.json", cwd=tmp_path), fragment)


def test_from_json_reads_to_a_bound(saved_json, tmp_path, monkeypatch):
    (tmp_path / "s.json").write_text(json.dumps(saved_json))
    size = (tmp_path / "s.json").stat().st_size
    monkeypatch.setattr(inputs, "MAX_SCHEDULE_BYTES", size - 1)
    refused(cli("plan", "--from-json", "s.json", cwd=tmp_path), f"s.json: {size:,} bytes, above the 0 MiB",
            "MAX_SCHEDULE_BYTES", "plan the rollout again from its lengths")
    monkeypatch.setattr(inputs, "MAX_SCHEDULE_BYTES", size)  # exactly at the bound: read, in many small chunks
    monkeypatch.setattr(inputs, "READ_CHUNK_BYTES", 7)
    res = cli("plan", "--from-json", "s.json", cwd=tmp_path)
    assert res.rc == 0 and res.stdout.startswith("valid: s.json"), res.stdout + res.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_from_json_pipe_without_a_size_is_read_to_the_bound(tmp_path, monkeypatch):
    """A pipe has st_size 0, so the size check passes: the chunked read stops one chunk past the bound."""
    import threading

    monkeypatch.setattr(inputs, "MAX_SCHEDULE_BYTES", 1000)
    monkeypatch.setattr(inputs, "READ_CHUNK_BYTES", 64)
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    written = []

    def writer():
        try:
            with open(fifo, "wb", buffering=0) as f:
                for _ in range(10_000):  # 10 MB offered; the reader stops after ~1 KB and closes the pipe
                    f.write(b"{" + b" " * 1023)
                    written.append(1)
        except BrokenPipeError:
            pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    refused(cli("plan", "--from-json", fifo), "p.json: more bytes than that, above the", "MAX_SCHEDULE_BYTES")
    t.join(timeout=30)
    assert not t.is_alive() and len(written) < 10_000


def test_from_json_memory_error_while_parsing_is_one_line(saved_json, tmp_path, monkeypatch):
    (tmp_path / "s.json").write_text(json.dumps(saved_json))

    def no_memory(*a, **k):
        raise MemoryError

    monkeypatch.setattr(inputs.json, "loads", no_memory)
    refused(cli("plan", "--from-json", "s.json", cwd=tmp_path), "s.json: ", "bytes of JSON do not fit in this "
            "process's memory once parsed", "ulimit -v")


def test_memory_error_anywhere_in_a_command_is_one_line(monkeypatch):
    def no_memory(*a, **k):
        raise MemoryError

    monkeypatch.setattr(plan_cmd, "plan_schedule", no_memory)
    refused(cli("plan", "--synthetic", "lognormal:n=8", *GBS), "out of memory", "plan the rollout in parts",
            "ulimit -v")


#: the issue's address-space limit (KiB): a 4 GiB read() died under it before the reader was bounded
ULIMIT_V = 3_000_000


@pytest.mark.skipif(sys.platform != "linux" or not os.path.exists("/bin/bash"), reason="needs bash's ulimit -v")
def test_cli_processes_under_ulimit_v(saved_json, tmp_path):
    """Real ``python -m slime_ext.cli`` processes under ``ulimit -v 3000000``: a small saved schedule replays, one
    above MAX_SCHEDULE_BYTES (a sparse file: no disk used) is refused by its size, /dev/zero is refused after one
    chunk, and planning (JSONL .gz, synthetic with --compare) works: nothing asks for more than the limit."""
    (tmp_path / "small.json").write_text(json.dumps(saved_json))
    with open(tmp_path / "huge.json", "wb") as f:
        f.write(b"{")
        f.truncate(inputs.MAX_SCHEDULE_BYTES + 1)
    (tmp_path / "l.jsonl.gz").write_bytes(_gz(b'{"total_length": 100, "rollout_id": 0}\n' * 64))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def run(*args):
        cmd = f"ulimit -v {ULIMIT_V}; exec {sys.executable} -m slime_ext.cli plan " + " ".join(map(str, args))
        out = subprocess.run(["/bin/bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=120)
        return SimpleNamespace(rc=out.returncode, stdout=out.stdout, stderr=out.stderr)

    res = run("--from-json", "small.json")
    assert res.rc == 0 and res.stdout.startswith("valid: small.json"), res.stdout + res.stderr
    assert "Error" not in res.stderr, res.stderr
    refused(run("--from-json", "huge.json"), f"huge.json: {inputs.MAX_SCHEDULE_BYTES + 1:,} bytes, above the "
            "256 MiB --from-json reads")
    if os.path.exists("/dev/zero"):
        refused(run("--from-json", "/dev/zero"), "/dev/zero: does not start with a JSON object")
    res = run("l.jsonl.gz", "--global-batch-size", 1, "--use-dynamic-batch-size", "--max-tokens-per-gpu", 4096,
              "--no-legend")
    assert res.rc == 0 and "l.jsonl.gz" in res.stdout, res.stdout + res.stderr
    res = run("--synthetic", "lognormal:n=512", "--global-batch-size", 64, "--use-dynamic-batch-size",
              "--max-tokens-per-gpu", 16384, "--compare", "legacy,reference", "-q", "--no-legend")
    assert res.rc == 0 and "legacy" in res.stdout, res.stdout + res.stderr


def _paths(obj):
    return json_paths(obj, list_items=(0, -1))


@settings(max_examples=examples(150), parent=SHARED_TMP)
@given(st.data(), JSON_VALUES)
def test_any_edit_of_a_saved_schedule_is_valid_or_invalid_never_a_crash(saved_json, tmp_path, data, value):
    path = data.draw(st.sampled_from(list(_paths(saved_json))), label="path")
    edited = copy.deepcopy(saved_json)
    if path:
        node = edited
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    else:
        edited = value
    (tmp_path / "e.json").write_text(json.dumps(edited))
    res = cli("plan", "--from-json", tmp_path / "e.json")
    assert "Traceback" not in res.stdout + res.stderr
    if not isinstance(edited, dict):
        refused(res, "e.json: ")
    else:
        assert res.rc in (0, 1), res.stdout + res.stderr
        assert res.stdout.startswith("valid:" if res.rc == 0 else "INVALID:"), res.stdout


# ---------------------------------------------------------------------------------------------------- processes
def test_real_processes(tmp_path):
    """The process path: exit 2, one line on stderr, no traceback, nothing on stdout; /dev/zero ends."""
    (tmp_path / "c.gz").write_bytes(JSONL_CASES[0][1])
    (tmp_path / "deep.json").write_bytes(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    cases = [
        (["c.gz", *GBS], "c.gz:1: cannot read"),
        (["--from-json", "deep.json"], "deep.json: JSON nested too deeply"),
        (["--synthetic", "lognormal:n=10000000000000", *GBS], "n=10000000000000 is outside"),
    ]
    if os.path.exists("/dev/zero"):
        cases.append((["/dev/zero", *GBS], "/dev/zero:1: the line is longer than 64 MiB"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for args, fragment in cases:
        out = subprocess.run([sys.executable, "-m", "slime_ext.cli", "plan", *map(str, args)], capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=120)
        refused(SimpleNamespace(rc=out.returncode, stdout=out.stdout, stderr=out.stderr), fragment)
