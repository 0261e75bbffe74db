"""`rejax bench` on the bundled model (CPU, seconds) and the bench helpers on a random config."""

import json
import struct
import subprocess

import pytest

from rejax import bench, cli
from rejax.config import Config

TINY_WEIGHTS = cli.bundled_model_dir() / "model.safetensors"


def _tensor_bytes(path) -> dict[str, int]:
    # safetensors: u64 header length, JSON header {name: {"data_offsets": [start, end]}}.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}


def test_bench_on_the_bundled_model(capsys, tmp_path):
    out = tmp_path / "bench.json"
    rc = cli.main(
        ["bench", "--quant", "bf16", "--new-tokens", "8", "--prompt-len", "8", "--repeats", "2",
         "--copy-mib", "16", "--out", str(out)]
    )  # fmt: skip
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out.read_text())
    (run,) = r["runs"]
    cfg = r["config"]
    assert (run["quant"], run["batch"], run["new_tokens"], run["steps"]) == ("bf16", 1, 8, 8)
    assert run["tokens_per_s"] == pytest.approx(1e3 / run["ms_per_token"])
    # Weights read per step: every tensor in the checkpoint but the embedding table.
    sizes = _tensor_bytes(TINY_WEIGHTS)
    assert run["weight_bytes"] == sum(sizes.values()) - sizes["model.embed_tokens.weight"]
    kv = 2 * cfg["num_layers"] * 1 * (8 + 8) * cfg["num_kv_heads"] * cfg["head_dim"] * 2
    assert kv <= run["kv_bytes"] <= kv + 1024  # keys + values, plus slot positions and index
    step_s = run["ms_per_token"] / 1e3
    assert run["bandwidth_GBps"] == pytest.approx(run["bytes_per_step"] / step_s / 1e9)
    assert run["share_of_copy"] == pytest.approx(run["bandwidth_GBps"] / r["copy_ceiling_GBps"])
    assert run["prefill_ms"] > 0 and run["decode_first_call_s"] > 0
    assert len(run["decode_runs_s"]) == 2
    assert r["versions"]["device"] and r["versions"]["jax"]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        cwd=cli.bundled_model_dir(),
        check=False,
    ).stdout.strip()
    assert r["versions"]["git_sha"] == (head or None)
    assert "ms/token" in stdout and "copy ceiling" in stdout and f"wrote {out}" in stdout


def _all_bytes(params) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params.weights))


def test_random_params_modes():
    cfg = Config()  # 2 layers, D=64, V=256
    models = {q: bench._random_params(cfg, q, 0) for q in ("bf16", "nvfp4")}
    assert models["nvfp4"].cfg.quant == "nvfp4" and models["bf16"].cfg.quant is None
    d, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = layers * d * (2 * q + 2 * kv + 3 * f)  # q, o, k, v, gate, up, down weights
    head = cfg.vocab_size * d
    # bf16: 2 bytes per weight; NVFP4: half a byte per code plus one E4M3 scale per 16.
    assert bench.weight_bytes(models["bf16"]) >= 2 * (linear + head)
    nvfp4 = bench.weight_bytes(models["nvfp4"]) - (bench.weight_bytes(models["bf16"]) - 2 * linear)
    assert linear * (0.5 + 1 / 16) <= nvfp4 <= linear * (0.5 + 1 / 16) + 64 * layers * 7
    for q, m in models.items():
        assert bench.estimate_weight_bytes(cfg, q) == pytest.approx(_all_bytes(m), rel=0.02)
    with pytest.raises(ValueError, match="unknown quant 'fp8'"):
        bench._random_params(cfg, "fp8", 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "2"], "--layers applies to --preset only"),
        (["--preset", "qwen3-8b", "--prompt-len", "40000", "--new-tokens", "2000"],
         "= 42000 exceeds the context of 40960"),
        (["--prompt-len", "1000", "--new-tokens", "100"], "exceeds the model's context of 1024"),
    ],
)  # fmt: skip
def test_bench_bad_arguments(capsys, argv, message):
    rc = cli.main(["bench", "--quant", "bf16", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_bench_refuses_a_preset_larger_than_the_device(capsys, monkeypatch):
    monkeypatch.setattr(bench, "device_memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr(bench, "_random_params", lambda *a: pytest.fail("built the weights"))
    rc = cli.main(["bench", "--preset", "qwen3-8b", "--quant", "nvfp4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--preset qwen3-8b with 36 layers needs about 15." in err, err
    assert "pass --layers N" in err


def test_bench_model_and_preset_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--model", "tiny", "--preset", "qwen3-8b"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_source_digest_names_the_code(tmp_path):
    """`versions()` records a digest of the sources that changes with any of them (and with a
    renamed file), so a result names its tree where git's HEAD does not."""
    v = bench.versions()
    assert len(v["source_digest"]) == 16 and v["source_digest"] == bench.source_digest()
    root = tmp_path / "rejax"
    (root / "ops").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "ops" / "k.cu").write_text("// kernel\n")
    (root / "notes.md").write_text("not code\n")
    first = bench.source_digest([root])
    (root / "notes.md").write_text("changed\n")
    assert bench.source_digest([root]) == first
    (root / "ops" / "k.cu").write_text("// kernel v2\n")
    second = bench.source_digest([root])
    assert second != first
    (root / "a.py").rename(root / "b.py")
    assert bench.source_digest([root]) != second


def test_versions_record_the_declared_commit(monkeypatch):
    """`versions()` keeps git's HEAD as `git_sha` and records the commit the caller names in
    GIT_SHA as `git_sha_declared` (a device machine's copied tree may carry an older HEAD)."""
    monkeypatch.delenv("GIT_SHA", raising=False)
    assert bench.versions()["git_sha_declared"] is None
    monkeypatch.setenv("GIT_SHA", "9bd13b7")
    v = bench.versions()
    assert v["git_sha_declared"] == "9bd13b7"
    assert v["git_sha"] != "9bd13b7"  # HEAD is still git's own
    monkeypatch.setenv("GIT_SHA", "")
    assert bench.versions()["git_sha_declared"] is None


def test_copy_ceiling_counts_every_pass(monkeypatch):
    # bytes = read + write of the buffer per pass, over the median call time; a call runs
    monkeypatch.setattr(bench, "_time", lambda run, repeats: (0.0, 0.5, [0.5]))
    assert bench.copy_ceiling(1 << 20, repeats=1, passes=3) == 2 * (1 << 20) * 3 / 0.5
    monkeypatch.undo()
    assert bench.copy_ceiling(1 << 20, repeats=1, passes=2) > 0
    with pytest.raises(ValueError, match="passes must be >= 1"):
        bench.copy_ceiling(1 << 20, passes=0)
