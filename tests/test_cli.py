"""Tests for the `rejax` command line and `python -m rejax.demo`: documented options, clear
errors for bad input, and generate / eval / calibrate end to end on a tiny random checkpoint."""

import argparse
import dataclasses
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import rejax
from rejax import cli, demo, torch_ref
from rejax import eval as ev
from rejax.decode import decode_step, prefill
from rejax.generate import generate
from rejax.sampling import Greedy
from rejax.text import encode_prompt, step_spans

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(chat_checkpoint):
    return chat_checkpoint


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
def data(tmp_path, math_problems):
    f = tmp_path / "problems.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in math_problems))
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


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options(command: str) -> tuple[set[str], set[str]]:
    """(long flags, positional metavars) the parser of `command` accepts."""
    flags, positionals = set(), set()
    for action in _subparsers()[command]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            flags.update(o for o in action.option_strings if o.startswith("--"))
        else:
            positionals.add(action.metavar or action.dest)
    return flags, positionals


def _readme_synopsis() -> dict[str, str]:
    """README "Command line" code block, split into one synopsis per command."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Command line", 1)[1]
    block = section.split("```", 2)[1]
    out: dict[str, str] = {}
    command = None
    for line in block.splitlines():
        m = re.match(r"rejax (\w+)", line)
        if m:
            command = m.group(1)
            out[command] = line
        elif line.strip() and command is not None:
            out[command] += " " + line.strip()
    return out


COMMANDS = sorted(_subparsers())


def test_readme_lists_every_command():
    assert sorted(_readme_synopsis()) == COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_synopsis_matches_the_parser(command):
    synopsis = _readme_synopsis()[command]
    flags, positionals = _options(command)
    documented = set(re.findall(r"--[a-z][a-z0-9-]*", synopsis))
    assert documented == flags, (
        f"rejax {command}: README lacks {sorted(flags - documented)}, "
        f"README has unknown {sorted(documented - flags)}"
    )
    for name in positionals:
        assert re.search(rf"[\[\s]{name}\b", synopsis), (command, name)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_every_option(capsys, command):
    text = _help(capsys, command)
    flags, positionals = _options(command)
    for option in flags | positionals:
        assert re.search(rf"(^|[\s\[,]){re.escape(option)}\b", text), (command, option)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert command in capsys.readouterr().out


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
    spans = step_spans(tokens, nl, dnl)
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


def test_eval_writes_jsonl_and_summary(capsys, ckpt, data, tmp_path, cached_models, math_problems):
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
    assert [r["prompt"] for r in rows] == [p["problem"] for p in math_problems]
    assert all(len(r["responses"]) == len(r["correct"]) == 1 for r in rows)
    s = json.loads(summary.read_text())
    n_correct = sum(r["n_correct"] for r in rows)
    assert s["avg_at_n"]["avg"] == pytest.approx(n_correct / 3)
    assert (s["n"], s["n_problems"], s["quant"], s["max_new_tokens"]) == (1, 3, "bf16", 8)
    assert s["sampler"]["kind"] == "Temperature" and s["sampler"]["t"] == 0.7
    assert stdout.startswith("avg@1 = ") and "95% CI" in stdout


def test_eval_slots_summary_line(capsys, ckpt, data, tmp_path, cached_models):
    # 3 problems x n=1 through 2 slots: with compaction the third row runs in a 1-row program;
    # --no-slots-compact keeps every step at 2. Same responses either way.
    results = {}
    for flag in ("--slots-compact", "--no-slots-compact"):
        out, summary = tmp_path / f"{flag}.jsonl", tmp_path / f"{flag}.json"
        rc, _, err = _run(
            capsys,
            *("eval", "--model", ckpt, "--quant", "bf16", "--data", data, "--n", 1),
            *("--max-new-tokens", 8, "--sampler", "temp:0.7", "--slots", 2, flag),
            *("--out", out, "--summary", summary, "--no-progress"),
        )
        assert rc == 0, err
        s = json.loads(summary.read_text())
        line = [x for x in err.splitlines() if x.startswith("# 2 slots")]
        assert len(line) == 1 and f"occupancy {s['slot_occupancy']:.3f}" in line[0], err
        assert "tok/s" in line[0] and ("compacting" in line[0]) == (flag == "--slots-compact")
        assert s["slot_compact"] == (flag == "--slots-compact") and s["slots"] == 2
        results[flag] = ([json.loads(x)["responses"] for x in out.read_text().splitlines()], s)
    (a, ca), (b, cb) = results.values()
    assert a == b
    assert list(cb["slot_steps_by_size"]) == ["2"] and list(ca["slot_steps_by_size"]) == ["2", "1"]
    assert ca["slot_occupancy"] > cb["slot_occupancy"]


def test_eval_prefill_rows_reaches_generate(capsys, ckpt, data, tmp_path, cached_models):
    # --prefill-rows 2: batches prefill in chunks of 2 prompts (a chunk program traced), with
    # the responses of one prefill per batch; 0 is refused by the parser
    import importlib

    gen = importlib.import_module("rejax.generate")
    responses = []
    for extra in ((), ("--prefill-rows", 2)):
        out = tmp_path / f"p{len(extra)}.jsonl"
        before = gen.TRACE_COUNTS["prefill_rows"]
        rc, _, err = _run(
            capsys,
            *("eval", "--model", ckpt, "--quant", "bf16", "--data", data, "--n", 2),
            *("--max-new-tokens", 8, "--sampler", "temp:0.7", *extra),
            *("--out", out, "--no-progress"),
        )
        assert rc == 0, err
        assert (gen.TRACE_COUNTS["prefill_rows"] > before) == bool(extra)
        responses.append([json.loads(x)["responses"] for x in out.read_text().splitlines()])
    assert responses[0] == responses[1]
    with pytest.raises(SystemExit):
        _run(capsys, "eval", "--model", ckpt, "--data", data, "--prefill-rows", 0)


def test_eval_countdown_grades_with_the_exact_checker(capsys, ckpt, tmp_path, cached_models):
    from rejax.data import countdown
    from rejax.eval.grading import grade_detail

    data, out, summary = tmp_path / "cd.jsonl", tmp_path / "cd_out.jsonl", tmp_path / "cd.json"
    countdown.write_jsonl(countdown.split("test", 2), data)
    rc, stdout, err = _run(
        capsys,
        *("eval", "--task", "countdown", "--model", ckpt, "--quant", "bf16", "--data", data),
        *("--n", 1, "--max-new-tokens", 8, "--batch-size", 2, "--no-progress"),
        *("--out", out, "--summary", summary),
    )
    assert rc == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    statuses = []
    for row in rows:
        g = grade_detail(row["responses"][0], row["reference"], task="countdown")
        assert row["correct"] == [g.correct] and row["extracted"] == [g.extracted]
        statuses += [] if g.correct else [g.failure["status"]]
    s = json.loads(summary.read_text())
    assert s["task"] == "countdown" and s["n_problems"] == 2
    assert (
        sum(s["failure_status"].values()) == len(statuses) == 2 - sum(r["n_correct"] for r in rows)
    )
    assert "failures: " in stdout


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
        "--reset-json",
        tmp_path / "model_settings" / "reset.json",
    )
    assert rc == 0, err
    s = json.loads((tmp_path / "cal.json").read_text())
    dump = np.load(tmp_path / "cal_entropies.npz")
    assert s["tau0"] == pytest.approx(np.percentile(dump["nvfp4_raw"], 80))
    assert s["reference_bf16"]["n_tokens"] == dump["bf16_raw"].size
    assert s["quant"] == "nvfp4" and s["used"] == "raw"
    assert f"tau0 = {s['tau0']:.4g} nats" in stdout
    # The flags to paste, and the same values as the model's settings file.
    tau0 = float(f"{s['tau0']:.4g}")
    assert f"--sampler reset --tau0 {tau0:g} --t-low 0.3" in stdout
    saved = cli.read_reset_settings(tmp_path / "model_settings")
    assert saved == {"tau_0": tau0, "t_low": 0.3}
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


def test_stream_response_matches_generate(ckpt, cached_models):
    params = cli.load_model(str(ckpt), "nvfp4")
    sampler = ev.parse_sampler("reset", tau0=4.0)
    buf = io.StringIO()
    res = cli.stream_response(
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
    monkeypatch.setattr(cli, "bundled_model_dir", lambda: tmp_path / "absent")
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "generation-free" in out and "NVFP4 weight [256, 1024]" in out
    temps = [float(m) for m in re.findall(r"^\s+\d+\s+[\d.]+\s+([\d.]+)\s", out, re.MULTILINE)]
    assert len(temps) == 14 and set(temps) == {0.3, 1.0}


# ----------------------------------------------------------------------------- issue 18 defects


class _Stop(Exception):
    """Raised by a spy in place of long work; the test then checks what it was called with."""


def _spy(calls: list):
    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Stop

    return spy


def test_eval_and_calibrate_defaults_fit_the_models_context(
    capsys, monkeypatch, ckpt, data, cached_models, math_problems
):
    params = cli.load_model(str(ckpt), "nvfp4")
    limit = params.cfg.max_position_embeddings  # 512 < the eval / calibrate defaults
    longest = max(len(encode_prompt(params, p["problem"], chat=True)) for p in math_problems)
    for command, target in (("eval", "evaluate"), ("calibrate", "calibrate_tau0")):
        calls: list = []
        monkeypatch.setattr(ev, target, _spy(calls))
        argv = [command, "--model", ckpt, "--data", data]
        if command == "calibrate":
            argv += ["--n-problems", 3, "--out", ckpt.parent / "cal"]
        with pytest.raises(_Stop):
            cli.main([str(a) for a in argv])
        assert calls[0][1]["max_new_tokens"] == limit - longest, command
        err = capsys.readouterr().err
        assert f"--max-new-tokens {limit - longest} (the default" in err
        assert f"context is {limit} tokens" in err


@pytest.mark.parametrize("prompt", ["", "   ", "-"])
def test_generate_rejects_an_empty_prompt(capsys, monkeypatch, prompt):
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("loaded the model"))
    rc, _, err = _run(capsys, "generate", prompt)
    assert rc == 2 and "is empty" in err and "expected a problem" in err, err


def test_generate_reads_stdin_and_streams_through_rejax_generate(monkeypatch, ckpt, cached_models):
    monkeypatch.setattr("sys.stdin", io.StringIO("Evaluate 3 + 4.\n"))
    calls: list = []
    monkeypatch.setattr(cli, "generate", _spy(calls))
    with pytest.raises(_Stop):
        cli.main(["generate", "--model", str(ckpt), "--max-new-tokens", "5", "-"])
    ((args, kwargs),) = calls
    assert args[1] == "Evaluate 3 + 4."
    assert callable(kwargs["stream"]) and callable(kwargs["on_token"])
    assert kwargs["max_new_tokens"] == 5


def test_bf16_on_an_nvfp4_checkpoint_is_refused(capsys, tmp_path, ckpt, cached_models):
    nvfp4 = tmp_path / "nvfp4"
    rejax.save(cli.load_model(str(ckpt), "nvfp4"), nvfp4)
    rc, _, err = _run(capsys, "generate", "--model", nvfp4, "--quant", "bf16", "hi")
    assert rc == 2 and "is an NVFP4 checkpoint (nvfp4)" in err, err
    with pytest.raises(ValueError, match="float weights are not in it"):
        rejax.load(nvfp4, quant="bf16")
    assert rejax.load(ckpt, quant="bf16").cfg.quant is None


def test_output_paths_are_checked_before_any_work(capsys, monkeypatch, tmp_path, data):
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("loaded the model"))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        (["eval", "--data", data, "--out", a_file / "r.jsonl"], "--out", "is a file"),
        (["eval", "--data", data, "--summary", tmp_path], "--summary", "is a directory"),
        (["calibrate", "--out", a_file], "--out", "is a file; expected a directory"),
        (["calibrate", "--reset-json", tmp_path], "--reset-json", "is a directory"),
        (["bench", "--out", a_file / "b.json"], "--out", "is a file"),
        (["compare", "--out", tmp_path], "--out", "is a directory"),
    ]
    for argv, flag, message in cases:
        rc, _, err = _run(capsys, *argv)
        assert rc == 2 and f"error: {flag} " in err and message in err, (argv, err)


def test_model_reset_json_sets_the_reset_defaults(tmp_path, ckpt):
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    (model / "reset.json").write_text('{"tau_0": 0.25, "t_low": 0.2, "source": "test"}')
    parse = cli.build_parser().parse_args
    sampler, source = cli._sampler(parse(["generate", "--model", str(model), "hi"]), model)
    assert (float(sampler.tau_0), float(sampler.t_low), float(sampler.t_high)) == (0.25, 0.2, 1.0)
    assert "tau0, t-low from the model's reset.json" in source
    explicit = parse(["generate", "--model", str(model), "--tau0", "0.5", "hi"])
    assert float(cli._sampler(explicit, model)[0].tau_0) == 0.5
    assert float(cli._sampler(explicit, ckpt)[0].t_low) == 0.3  # no file: the paper's value
    (model / "reset.json").write_text('{"tau_0": "low"}')
    with pytest.raises(ValueError, match=r"reset.json: tau_0 must be a finite number >= 0"):
        cli._sampler(parse(["generate", "hi"]), model)


def test_bundled_model_carries_the_readme_calibration():
    saved = cli.read_reset_settings(cli.bundled_model_dir())
    assert saved == {"tau_0": 7.699e-05, "t_low": 0.1}
    readme = (REPO / "README.md").read_text()
    assert "τ₀ = 7.7e-5 nats" in readme and "T_low = 0.1" in readme


def test_readme_api_tour_names_resolve():
    readme = (REPO / "README.md").read_text()
    # `rejax.generate` is the function, so `rejax.generate.prefill` is an AttributeError.
    assert "`rejax.generate.prefill`" not in readme
    assert "`rejax.decode.prefill` and `decode_step`" in readme
    assert callable(prefill) and callable(decode_step)
    assert "from rejax import torch_ref" in readme
    assert callable(torch_ref.forward)
    assert "per-token dynamic" not in readme and "per-row (per-token) dynamic" in readme
    assert '"bf16"' in readme.split("## API tour")[1].split("## Command line")[0]
    assert "rejax.Temperature` defaults to `top_p=1.0`" in readme


def test_step_printer_shows_small_entropies():
    nl, dnl = np.zeros(8, bool), np.zeros(8, bool)
    dnl[2] = True
    printer = cli._StepPrinter(nl, dnl, ev.parse_sampler("temp:0.6"))
    printer.push(3, 1.0e-5, 0.6)
    line = printer.push(2, 3.0e-5, 0.6)
    assert "entropy mean 2.0e-05 max 3.0e-05 nats" in line, line
    assert cli.format_nats(0.0) == "0" and cli.format_nats(0.5) == "0.50"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sampler", "greedy", "--tau0", "0.1"], "--tau0 0.1 does not apply to --sampler 'gre"),
        (["--sampler", "greedy", "--top-p", "0.9"], "--top-p 0.9 does not apply"),
        (["--sampler", "temp:0.6", "--t-low", "0.2"], "--t-low 0.2 does not apply"),
        (["--sampler", "temp:0.6", "--include-current"], "--include-current does not apply"),
    ],
)
def test_options_the_sampler_does_not_read_are_refused(capsys, monkeypatch, ckpt, argv, message):
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("loaded the model"))
    rc, _, err = _run(capsys, "generate", "--model", ckpt, *argv, "hi")
    assert rc == 2 and message in err, err


def test_model_path_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    rc, _, err = _run(capsys, "generate", "--model", f, "hi")
    assert rc == 2 and f"model path '{f}' is a file; expected a checkpoint directory" in err


# ----------------------------------------------------------------------------- issue 18 features


def test_read_prompts_from_lines_and_jsonl(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('Evaluate 1 + 1.\n\n{"prompt": "Evaluate 2 + 2."}\n{"problem": "Evaluate 3."}\n')
    args = cli.build_parser().parse_args(["generate", "--prompts", str(f)])
    assert cli._read_prompts(args) == ["Evaluate 1 + 1.", "Evaluate 2 + 2.", "Evaluate 3."]
    f.write_text('{"prompt": "  "}\n')
    with pytest.raises(ValueError, match=r"p.txt:1: expected a non-empty string field"):
        cli._read_prompts(args)
    both = cli.build_parser().parse_args(["generate", "--prompts", str(f), "hi"])
    with pytest.raises(ValueError, match="got both"):
        cli._read_prompts(both)


def test_generate_prompts_file_n_and_json(capsys, tmp_path, ckpt, cached_models):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "Evaluate 5 - 2."}\n')
    # Two rows of 8 tokens with temp:0.7 and bf16: the compiled shapes of the eval test.
    rc, out, err = _run(
        capsys, "generate", "--model", ckpt, "--quant", "bf16", "--sampler", "temp:0.7",
        "--prompts", f, "--n", 2, "--max-new-tokens", 8, "--seed", 4, "--json",
    )  # fmt: skip
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    params = cli.load_model(str(ckpt), "bf16")
    ref = generate(
        params, ["Evaluate 5 - 2."], n=2, max_new_tokens=8, key=4, chat=True,
        sampler=ev.parse_sampler("temp:0.7"),
    )  # fmt: skip
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [(0, 0), (0, 1)]
    assert [r["tokens"] for r in rows] == ref.tokens
    assert [r["text"] for r in rows] == ref.text
    assert [r["finish_reason"] for r in rows] == ref.finish_reason
    for r, h, t in zip(rows, ref.entropy, ref.temperature):
        np.testing.assert_allclose(r["entropy"], h, rtol=1e-6)
        assert r["temperature"] == pytest.approx(t)


def test_kv_dtype_flag(capsys, tmp_path, ckpt, cached_models):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "Evaluate 5 - 2."}\n')
    rc, out, err = _run(
        capsys, "generate", "--model", ckpt, "--quant", "bf16", "--kv-dtype", "fp8",
        "--sampler", "greedy", "--prompts", f, "--max-new-tokens", 8, "--json",
    )  # fmt: skip
    assert rc == 0, err
    params = cli.load_model(str(ckpt), "bf16")
    p8 = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, kv_dtype="fp8"))
    ref = generate(p8, ["Evaluate 5 - 2."], max_new_tokens=8, chat=True, sampler=Greedy())
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert [row["tokens"]] == ref.tokens
    np.testing.assert_allclose(row["entropy"], ref.entropy[0], rtol=1e-6)
    bf16 = generate(params, ["Evaluate 5 - 2."], max_new_tokens=8, chat=True, sampler=Greedy())
    assert not np.allclose(bf16.entropy[0], ref.entropy[0], rtol=1e-6)  # the flag mattered
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--kv-dtype", "int8", "hi"])
    assert e.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_xla_autotune_flag(capsys, tmp_path, ckpt, cached_models, monkeypatch):
    """--xla-autotune on / off reaches Config.xla_autotune of the decoded params (the CLI's
    default is off); on the CPU the tokens are the same; a bad value is refused."""
    seen = []
    real = cli.generate

    def spy(params, *a, **k):
        seen.append(params.cfg.xla_autotune)
        return real(params, *a, **k)

    monkeypatch.setattr(cli, "generate", spy)
    outs = []
    for flag in (["--xla-autotune", "on"], []):
        rc, out, err = _run(
            capsys, "generate", "--model", ckpt, "--quant", "bf16", *flag,
            "--sampler", "greedy", "--max-new-tokens", 6, "--json", "Evaluate 5 - 2.",
        )  # fmt: skip
        assert rc == 0, err
        outs.append(json.loads(out.splitlines()[0])["tokens"])
    assert seen == [True, False] and outs[0] == outs[1]
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--xla-autotune", "maybe", "hi"])
    assert e.value.code == 2
    assert "invalid choice: 'maybe'" in capsys.readouterr().err


def test_load_model_states_the_scale_mode_once(caplog):
    """`load_model` drops rejax.load's dynamic-scale warning (the CLI prints its own header
    line); a direct rejax.load still warns."""
    import logging

    import rejax.data
    from rejax import cli as cli_mod

    with caplog.at_level(logging.WARNING):
        cli_mod.load_model("tiny", "nvfp4")
    assert not [r for r in caplog.records if "without calibration data" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rejax.load(rejax.data.TINY_MODEL, quant="nvfp4")
    assert [r for r in caplog.records if "without calibration data" in r.getMessage()]


# ----------------------------------------------------------------------------- --scale-texts

# Two calibration texts in the checkpoint's chat format, of equal length (one token per
# character and special token): one compiled calibration forward per call.
_SCALE_TEXTS = [
    "<|im_start|>user\nEvaluate 1 + 2.<|im_end|>\n<|im_start|>assistant\n3<|im_end|>",
    "<|im_start|>user\nEvaluate 4 * 5.<|im_end|>\n<|im_start|>assistant\n9<|im_end|>",
]
_CALIBRATED: dict = {}


def _scale_file(tmp_path, texts=tuple(_SCALE_TEXTS), name="scales.jsonl"):
    f = tmp_path / name
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return f


def _input_scales(params) -> dict:
    import jax

    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params.weights)
        if "input_scale" in jax.tree_util.keystr(path)
    }


def _calibrated_scales(ckpt) -> dict:
    """The library's scales for _SCALE_TEXTS (computed once per module)."""
    from rejax.generate import calibrate_input_scales

    if not _CALIBRATED:
        params = calibrate_input_scales(cli.load_model(str(ckpt), "nvfp4"), _SCALE_TEXTS)
        _CALIBRATED.update(_input_scales(params))
    return _CALIBRATED


def test_eval_scale_texts_sets_static_activation_scales(
    capsys, monkeypatch, ckpt, data, tmp_path, cached_models
):
    """`rejax eval --scale-texts` runs the model with the input scales that
    rejax.calibrate_input_scales gives on the file's texts (the loaded model has none)."""
    assert not _input_scales(cli.load_model(str(ckpt), "nvfp4"))  # dynamic without the option
    seen = []
    real = ev.evaluate

    def spy(params, *a, **k):
        seen.append(params)
        return real(params, *a, **k)

    monkeypatch.setattr(ev, "evaluate", spy)
    f, summary = _scale_file(tmp_path), tmp_path / "summary.json"
    rc, stdout, err = _run(
        capsys, "eval", "--model", ckpt, "--quant", "nvfp4", "--scale-texts", f,
        "--data", data, "--limit", 1, "--n", 1, "--max-new-tokens", 4, "--sampler", "greedy",
        "--summary", summary, "--no-progress",
    )  # fmt: skip
    assert rc == 0, err
    assert stdout.startswith("avg@1 = ")
    assert f"# static activation scales calibrated on 2 texts ({2 * 36} tokens)" in err, err
    assert "NVFP4 W4A4 (static activation scales)" in err
    (params,) = seen
    got, want = _input_scales(params), _calibrated_scales(ckpt)
    # Every linear (layers stacked: qkv, o, gate_up, down), one scale per layer.
    assert len(got) == 4 and got.keys() == want.keys()
    assert all(x.shape == (2,) and np.all(x > 0) for x in got.values())
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert json.loads(summary.read_text())["scale_texts"] == {"file": str(f), "n_texts": 2}


@pytest.mark.parametrize("command", ["calibrate", "generate"])
def test_calibrate_and_generate_scale_texts(capsys, monkeypatch, ckpt, tmp_path, command):
    """The same option on `rejax calibrate` and `rejax generate`: the params that reach tau0
    calibration / generation carry the calibrated scales, and the header line says so."""
    monkeypatch.setattr(cli, "load_model", lambda spec, quant: _load_model(spec, quant))
    calls: list = []
    target = (ev, "calibrate_tau0") if command == "calibrate" else (cli, "generate")
    monkeypatch.setattr(*target, _spy(calls))
    f = _scale_file(tmp_path)
    argv = [command, "--model", ckpt, "--scale-texts", f, "--max-new-tokens", 4]
    argv += ["--out", tmp_path / "cal"] if command == "calibrate" else ["Evaluate 2 + 2."]
    with pytest.raises(_Stop):
        cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "static activation scales calibrated on 2 texts" in err
    assert "NVFP4 W4A4 (static activation scales)" in err
    ((args, _),) = calls
    got, want = _input_scales(args[0]), _calibrated_scales(ckpt)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("command", ["eval", "calibrate", "generate"])
def test_bad_scale_texts_are_refused_before_loading(capsys, monkeypatch, tmp_path, data, command):
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("loaded the model"))
    good = _scale_file(tmp_path)
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"text": "a"}\n\n{"prompt": "b"}\n')
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": "a"}\n{"text": "  "}\n')
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"text": "a"\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    missing = tmp_path / "none.jsonl"
    expected = "expected a JSON object with a non-empty string field 'text'"
    cases = [
        ([missing], f"--scale-texts '{missing}' does not exist or is not a file"),
        ([no_text], f'--scale-texts {no_text}:3: {expected}, got \'{{"prompt": "b"}}\''),
        ([blank], f"--scale-texts {blank}:2: {expected}"),
        ([malformed], f"--scale-texts {malformed}:1: malformed JSON"),
        ([empty], f"--scale-texts '{empty}' holds no texts"),
        ([good, "--quant", "bf16"], "it needs --quant nvfp4, got --quant bf16"),
        ([good, "--quant", "nvfp4-w4a16"], "it needs --quant nvfp4, got --quant nvfp4-w4a16"),
    ]
    extra = {
        "eval": ["--data", data],
        "calibrate": ["--data", data, "--out", tmp_path / "cal"],
        "generate": ["hi"],
    }[command]
    for flag_args, message in cases:
        rc, _, err = _run(capsys, command, *extra, "--scale-texts", *flag_args)
        assert rc == 2 and err.startswith(f"rejax {command}: error: "), (flag_args, err)
        assert message in err, (flag_args, err)


def test_scale_texts_longer_than_the_context_are_refused(capsys, monkeypatch, ckpt, tmp_path):
    monkeypatch.setattr(cli, "load_model", lambda spec, quant: _load_model(spec, quant))
    monkeypatch.setattr(cli, "calibrate_input_scales", lambda *a: pytest.fail("calibrated"))
    f = _scale_file(tmp_path, ["Evaluate 1 + 2.", "x" * 600])
    rc, _, err = _run(capsys, "generate", "--model", ckpt, "--scale-texts", f, "hi")
    assert rc == 2, err
    assert (
        f"--scale-texts {f}:2: the text has 600 tokens, more than the model's context of 512"
    ) in err


@pytest.mark.parametrize("model", ["countdown", "tiny"])
def test_calibrate_draws_its_default_problems_from_the_models_own_task(
    capsys, monkeypatch, tmp_path, model
):
    """Without --data, tau0 is calibrated on validation problems of the task the model was
    trained on: Countdown problems of its recorded difficulty for the bundled Countdown
    reasoner, arithmetic ones for the tiny model."""
    from rejax.data import COUNTDOWN_MODEL, countdown, tasks

    calls: list = []
    monkeypatch.setattr(ev, "calibrate_tau0", _spy(calls))
    argv = ["calibrate", "--model", model, "--n-problems", "3", "--out", str(tmp_path / "c")]
    with pytest.raises(_Stop):
        cli.main(argv)
    ((args, _),) = calls
    problems = args[1]
    if model == "countdown":
        d = countdown.load_difficulty(COUNTDOWN_MODEL)
        assert problems == countdown.split("validation", 3, difficulty=d)
        assert "rejax.data.countdown validation split" in capsys.readouterr().err
    else:
        assert problems == tasks.split("validation", 3)
        assert "rejax.data.tasks validation split" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_include_current_reaches_the_reset_sampler(command, tmp_path):
    """--include-current (the ablation) builds ReSET(include_current=True); without it the
    reference semantics; the label says which."""
    base = ["--data", str(tmp_path / "d.jsonl")] if command == "eval" else ["hi"]
    for flag, want in (([], False), (["--include-current"], True)):
        args = cli.build_parser().parse_args([command, *flag, *base])
        sampler, _ = cli._sampler(args)
        assert isinstance(sampler, rejax.ReSET) and sampler.include_current is want
        assert ("include_current" in cli.sampler_label(sampler)) is want
