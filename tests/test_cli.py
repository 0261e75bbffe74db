"""Tests for the `rejax` command line and `python -m rejax.demo`: documented options, clear
errors for bad input, and generate / eval / calibrate end to end on a tiny random checkpoint."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_evaluate import PROBLEMS, write_tiny_checkpoint

from rejax import cli

REPO = Path(__file__).resolve().parents[1]

# Every option the README documents, per command.
DOCUMENTED = {
    "generate": [
        "--model",
        "--quant",
        "--sampler",
        "--max-new-tokens",
        "--t-low",
        "--tau0",
        "--t-high",
        "--top-p",
        "--seed",
        "--chat",
        "--no-stats",
        "PROMPT",
    ],
    "eval": [
        "--data",
        "--n",
        "--model",
        "--quant",
        "--sampler",
        "--max-new-tokens",
        "--batch-size",
        "--limit",
        "--out",
        "--summary",
        "--ci",
        "--no-progress",
        "--t-low",
        "--tau0",
        "--t-high",
        "--top-p",
        "--seed",
        "--chat",
    ],
    "calibrate": [
        "--model",
        "--quant",
        "--data",
        "--n-problems",
        "--max-new-tokens",
        "--percentile",
        "--reference",
        "--out",
        "--prefix",
        "--seed",
        "--chat",
    ],
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_cli"))


_LOADED: dict = {}
_load_model = cli.load_model


@pytest.fixture
def cached_models(monkeypatch):
    """Loads each (model, quant) once per module: params carry their tokenizer as static jit
    metadata (hashed by identity), so a fresh load would recompile every jitted function."""

    def load(spec, quant):
        if (spec, quant) not in _LOADED:
            _LOADED[spec, quant] = _load_model(spec, quant)
        return _LOADED[spec, quant]

    monkeypatch.setattr(cli, "load_model", load)


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "problems.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return f


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _help(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


# ----------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", sorted(DOCUMENTED))
def test_help_lists_every_documented_option(capsys, command):
    text = _help(capsys, command)
    for option in DOCUMENTED[command]:
        assert re.search(rf"(^|[\s\[,]){re.escape(option)}\b", text), (command, option)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert command in capsys.readouterr().out


def test_readme_documents_every_option():
    readme = (REPO / "README.md").read_text()
    if "rejax eval" not in readme:
        pytest.skip("README.md has no command-line section yet")
    for command, options in DOCUMENTED.items():
        assert f"rejax {command}" in readme, command
        for option in options:
            assert option in readme, (command, option)


# ----------------------------------------------------------------------------- errors


def test_missing_model_path(capsys, tmp_path, data):
    missing = tmp_path / "no_such_model"
    for argv in (
        ["generate", "--model", missing, "hi"],
        ["eval", "--model", missing, "--data", data],
        ["calibrate", "--model", missing, "--data", data],
    ):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2
        assert f"model path '{missing}' does not exist" in err
        assert err.startswith(f"rejax {argv[0]}: error:")


def test_model_dir_without_config(capsys, tmp_path):
    rc, _, err = _run(capsys, "generate", "--model", tmp_path, "hi")
    assert rc == 2 and "has no config.json" in err


def test_missing_bundled_model(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "bundled_model_dir", lambda: tmp_path / "tiny")
    rc, _, err = _run(capsys, "generate", "--model", "tiny", "hi")
    assert rc == 2 and "the bundled tiny model is missing" in err


def test_tiny_resolves_to_the_packaged_model():
    assert cli.bundled_model_dir() == REPO / "rejax" / "data" / "tiny"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("temp:abc", "sampler spec 'temp:abc': temperature 'abc' is not a number"),
        ("temp:0", "sampler spec 'temp:0': temperature must be a finite number > 0"),
        ("nucleus", "unknown sampler spec 'nucleus'"),
    ],
)
def test_bad_sampler_spec(capsys, ckpt, data, spec, message):
    for argv in (
        ["generate", "--model", ckpt, "--sampler", spec, "hi"],
        ["eval", "--model", ckpt, "--data", data, "--sampler", spec],
    ):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2 and message in err, err


def test_missing_and_malformed_data(capsys, ckpt, tmp_path):
    rc, _, err = _run(capsys, "eval", "--model", ckpt, "--data", tmp_path / "none.jsonl")
    assert rc == 2 and "none.jsonl' does not exist" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": 1}\n{"problem": "b" "answer": 2}\n')
    rc, _, err = _run(capsys, "eval", "--model", ckpt, "--data", bad)
    assert rc == 2 and "bad.jsonl:2: malformed JSON" in err
    rc, _, err = _run(capsys, "calibrate", "--model", ckpt, "--data", bad)
    assert rc == 2 and "bad.jsonl:2: malformed JSON" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--data", "x.jsonl", "--n", "0"],
        ["eval", "--data", "x.jsonl", "--n", "-3"],
        ["eval", "--data", "x.jsonl", "--limit", "0"],
        ["generate", "--max-new-tokens", "0", "hi"],
        ["calibrate", "--n-problems", "0"],
        ["generate", "--tau0", "abc", "hi"],
    ],
)
def test_non_positive_counts_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected a positive integer, got" in err or "expected a number, got 'abc'" in err


def test_calibrate_needs_enough_problems(capsys, ckpt, data):
    rc, _, err = _run(capsys, "calibrate", "--model", ckpt, "--data", data, "--n-problems", 4)
    assert rc == 2 and "--n-problems 4 but" in err and "holds 3" in err


def test_step_printer_splits_like_step_spans():
    from rejax import evaluate as ev

    nl, dnl = np.zeros(8, bool), np.zeros(8, bool)
    nl[1], dnl[2] = True, True
    rng = np.random.default_rng(0)
    tokens = rng.choice([1, 1, 2, 3, 4, 5], size=200).tolist()
    sampler = ev.parse_sampler("reset", t_low=0.3)
    printer = cli._StepPrinter(nl, dnl, sampler)
    temps = rng.choice([0.3, 1.0], size=200)
    lines = [printer.push(t, 0.5, float(x)) for t, x in zip(tokens, temps)]
    lines.append(printer.flush())
    ends = [i + 1 for i, line in enumerate(lines[:-1]) if line]
    spans = ev.step_spans(tokens, nl, dnl)
    assert ends == [b for _, b in spans][: len(ends)]
    assert len([x for x in lines if x]) == len(spans)
    first = next(x for x in lines if x)
    a, b = spans[0]
    low = round(100 * np.mean(temps[a:b] == 0.3))
    assert first == (
        f"[step 1 | {b - a} tok | entropy mean 0.50 max 0.50 nats | "
        f"T_low {low}% T_high {100 - low}%]"
    )


# ----------------------------------------------------------------------------- end to end


def test_eval_writes_jsonl_and_summary(capsys, ckpt, data, tmp_path, cached_models):
    out, summary = tmp_path / "r" / "results.jsonl", tmp_path / "r" / "summary.json"
    # Same decode shapes as the calibration test below (2 rows, 8 tokens): one compilation.
    rc, stdout, err = _run(
        capsys,
        "eval",
        "--model",
        str(ckpt),
        "--quant",
        "bf16",
        "--data",
        data,
        "--n",
        1,
        "--max-new-tokens",
        8,
        "--sampler",
        "temp:0.7",
        "--batch-size",
        2,
        "--out",
        out,
        "--summary",
        summary,
        "--no-progress",
    )
    assert rc == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [p["problem"] for p in PROBLEMS]
    assert all(len(r["responses"]) == len(r["correct"]) == 1 for r in rows)
    s = json.loads(summary.read_text())
    n_correct = sum(r["n_correct"] for r in rows)
    assert s["avg_at_n"]["avg"] == pytest.approx(n_correct / 3)
    assert (s["n"], s["n_problems"], s["quant"], s["max_new_tokens"]) == (1, 3, "bf16", 8)
    assert s["sampler"]["kind"] == "Temperature" and s["sampler"]["t"] == 0.7
    assert stdout.startswith("avg@1 = ") and "95% CI" in stdout


def test_calibrate_writes_tau0_dumps_and_plot(capsys, ckpt, data, tmp_path, cached_models):
    rc, stdout, err = _run(
        capsys,
        "calibrate",
        "--model",
        str(ckpt),
        "--data",
        data,
        "--n-problems",
        2,
        "--max-new-tokens",
        8,
        "--out",
        tmp_path,
        "--prefix",
        "cal",
    )
    assert rc == 0, err
    s = json.loads((tmp_path / "cal.json").read_text())
    dump = np.load(tmp_path / "cal_entropies.npz")
    assert s["tau0"] == pytest.approx(np.percentile(dump["nvfp4_raw"], 80))
    assert s["reference_bf16"]["n_tokens"] == dump["bf16_raw"].size
    assert s["quant"] == "nvfp4" and s["used"] == "raw"
    assert f"tau0 = {s['tau0']:.4f} nats" in stdout
    pytest.importorskip("matplotlib")
    assert (tmp_path / "cal_entropy.png").stat().st_size > 1000


def test_generate_streams_text_and_step_stats(capsys, ckpt, cached_models):
    rc, stdout, err = _run(
        capsys,
        "generate",
        "--model",
        str(ckpt),
        "--quant",
        "nvfp4",
        "--max-new-tokens",
        12,
        "--seed",
        1,
        "Evaluate 2 + 2.",
    )
    assert rc == 0, err
    assert "NVFP4 W4A4" in err and "ReSET T_low=0.3" in err
    assert re.search(
        r"\[step 1 \| \d+ tok \| entropy mean [\d.]+ max [\d.]+ nats \| T_low "
        r"\d+% T_high \d+%\]",
        err,
    )
    assert re.search(r"# \d+ tokens, finish: (stop|length)", err)
    assert stdout.endswith("\n") and "[step" not in stdout


def test_stream_generate_matches_generate(ckpt, cached_models):
    import io

    from rejax import evaluate as ev
    from rejax.generate import generate

    params = cli.load_model(str(ckpt), "nvfp4")
    sampler = ev.parse_sampler("reset", tau0=4.0)
    buf = io.StringIO()
    res = cli.stream_generate(
        params,
        "Evaluate 7 * 6.",
        sampler=sampler,
        max_new_tokens=12,
        seed=5,
        chat=True,
        out=buf,
        err=buf,
    )
    ref = generate(params, "Evaluate 7 * 6.", sampler=sampler, max_new_tokens=12, key=5, chat=True)
    assert res["tokens"] == ref.tokens[0]
    np.testing.assert_allclose(res["temperature"], ref.temperature[0])
    np.testing.assert_allclose(res["entropy"], ref.entropy[0], atol=1e-2)
    assert buf.getvalue().startswith(res["text"])


def test_demo_fallback_without_bundled_model(capsys, monkeypatch, tmp_path):
    from rejax import demo

    monkeypatch.setattr(cli, "bundled_model_dir", lambda: tmp_path / "absent")
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "generation-free" in out and "NVFP4 weight [256, 1024]" in out
    temps = [float(m) for m in re.findall(r"^\s+\d+\s+[\d.]+\s+([\d.]+)\s", out, re.MULTILINE)]
    assert len(temps) == 14 and set(temps) == {0.3, 1.0}
