"""The command line: `pipejax plan` and a short `pipejax train`."""

import json

import flax.serialization
import matplotlib.pyplot as plt
import numpy as np

from pipejax.cli import main


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
    assert "padding" in captured.out and "stage 3" in captured.out and "bubble=0.429" in captured.out
    assert "no accelerator found; simulating 4 CPU devices" in captured.err


def test_train_learns_and_writes_metrics(tmp_path, capsys):
    code = main(["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
                 "--batch-size", "32", "--steps", "60", "--lr", "3e-3", "--quiet",
                 "--out", str(tmp_path / "run")])
    assert code == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_accuracy"] > 0.8 and last["steps"] == 60
    assert (tmp_path / "run" / "metrics.csv").read_text().startswith("epoch,loss,step")
    assert plt.imread(tmp_path / "run" / "curve.png").shape[:2] == (350, 600)  # 6 x 3.5 in, 100 dpi
    params = flax.serialization.msgpack_restore((tmp_path / "run" / "params.msgpack").read_bytes())
    assert params["1"]["params"]["kernel"].shape == (12, 256)  # layer 1: the first Dense


def test_train_another_model_with_evaluation(tmp_path, capsys):
    assert main(["train", "--model", "vgg", "--data", _data(tmp_path), "--stages", "4",
                 "--microbatches", "2", "--batch-size", "32", "--steps", "20", "--eval-every", "10",
                 "--quiet", "--out", str(tmp_path / "vgg")]) == 0
    rows = [json.loads(r) for r in (tmp_path / "vgg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "test_accuracy" in r and "seconds" not in r] == [10, 20]
    assert rows[-1]["model"] == "vgg" and len(rows[-1]["split"]) == 4


def test_plan_of_an_asynchronous_schedule_draws_it(tmp_path, capsys):
    png = tmp_path / "pb.png"
    assert main(["plan", "--data", _data(tmp_path), "--stages", "4", "--schedule", "pb",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "F0B-6" in out and "delays D_k [6, 4, 2, 0]" in out
    assert plt.imread(png).shape[:2] == (360, 600)  # K = 4 rows: 0.6 * 4 + 1.2 in, 100 dpi


def test_train_with_an_asynchronous_schedule_and_a_mitigation(tmp_path, capsys):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--microbatches", "2",
                 "--batch-size", "16", "--steps", "40", "--schedule", "pb", "--quiet",
                 "--optimizer", "momentum", "--lr", "0.02", "--mitigation", "lwp+sc",
                 "--out", str(tmp_path / "run")]) == 0
    assert "mitigation lwp+sc" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (summary["mitigation"], summary["delays"], summary["momentum"]) == ("lwp+sc", [2, 0], 0.9)


def test_a_mitigation_needs_an_asynchronous_schedule(tmp_path, capsys):
    assert main(["train", "--data", _data(tmp_path), "--stages", "2", "--mitigation", "sc"]) == 2
    assert "--schedule gpipe has none (use --schedule pb or pipedream)" in capsys.readouterr().err


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


def test_bench_writes_its_tables_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--only", "bubbles", "padding", "--out", str(out)]) == 0
    assert "(K-1)/(M+K-1)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["environment"]["jax"] and len(result["bubbles"]) == 8
    assert all(r["table_n=32"] == r["formula_n=32"] for r in result["bubbles"])
