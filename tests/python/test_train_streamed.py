"""`hytrain train --stream`: the job with its last layers' weights in host memory. On the CPU (the same
window logic as on the GPU): a streamed run is the resident run bit for bit (losses, checkpoint,
exported model), resumed too; what `--stream auto` decides on fake GPU budgets, before anything is
allocated; and the refusals in one line. On the GPU: a streamed run resumed from its checkpoint."""

import argparse
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hytrain import checkpoint as ckpt
from hytrain.job import main
from hytrain.job.models import stream_plan
from hytrain.job.options import ConfigError
from hytrain.models import LlamaConfig, LlamaModel
from hytrain.models.presets import PRESETS
from hytrain.window_plan import streams_when_auto

FAST = ["--batch-size", "4", "--seq-len", "64", "--no-progress", "--device", "cpu", "--workers", "1",
        "--precision", "bf16", "--eval-every", "0"]
GiB = 1 << 30


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_a_streamed_run_and_its_resume_are_the_resident_run_bit_for_bit(tmp_path, capsys):
    a, b, c = (str(tmp_path / n) for n in "abc")
    assert main(["--steps", "6", "--out", a, *FAST]) == 0
    assert main(["--steps", "6", "--out", b, "--stream", "2", *FAST]) == 0
    said = capsys.readouterr().out
    assert "2 of 4 layers streamed from host memory" in said, said
    assert main(["--steps", "3", "--out", c, "--stream", "2", *FAST]) == 0
    assert main(["--steps", "6", "--out", c, "--stream", "2", "--resume", "latest", *FAST]) == 0
    assert losses(a) == losses(b) == losses(c) and len(losses(a)) == 6
    summary = json.load(open(os.path.join(b, "summary.json")))
    assert (summary["streamed_layers"], summary["layers"], summary["kept_layers"],
            summary["made_resident"]) == (2, 4, 0, 0)
    assert 0 < summary["window_host_gb"] * 1e9 < 2 * summary["params"]  # bf16 weights of 2 of 4 layers
    assert "streamed_layers" not in json.load(open(os.path.join(a, "summary.json")))
    # The checkpoint and the exported model hold the streamed layers' weights (their homes), equal
    # to the resident run's.
    for name in ("checkpoints/step_00000006/model.safetensors", "model/model.safetensors"):
        ra, rb = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
        assert ra.keys() == rb.keys() and any("layers.3." in k for k in ra)
        assert all(torch.equal(ra[k], rb[k]) for k in ra), name
    # A streamed run's checkpoint resumes resident, and the other way round: streaming is placement.
    assert main(["--steps", "8", "--out", c, "--resume", "latest", "--stream", "off", *FAST]) == 0
    assert main(["--steps", "8", "--out", a, "--resume", "latest", "--stream", "3", *FAST]) == 0
    assert losses(a) == losses(c)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{"fp32-shards": an untied 4-layer Llama in fp32 safetensors shards (read into bf16: cast piece
    by piece), "bf16-tied": a tied one in one bf16 file (read by the kernel straight into its homes)}."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    root, out = tmp_path_factory.mktemp("hf"), {}
    for i, (kind, tied, dtype, shard) in enumerate((("fp32-shards", False, torch.float32, "40KB"),
                                                    ("bf16-tied", True, torch.bfloat16, "10GB"))):
        torch.manual_seed(i)
        cfg = HFConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=tied)
        LlamaForCausalLM(cfg).to(dtype).save_pretrained(root / kind, max_shard_size=shard)
        out[kind] = root / kind
    return out


@pytest.mark.parametrize("kind", ["fp32-shards", "bf16-tied"])
def test_a_streamed_pretrained_model_is_read_straight_into_its_homes(tmp_path, hf_models, corpus, monkeypatch,
                                                                     kind):
    # --model DIR streamed: built on the meta device, placed by stream_model, each streamed layer's
    # weights read from the files into its home and the rest onto the device (reads.py), never the
    # whole model in pageable memory; resumed, from the checkpoint the same way. The losses are the
    # resident run's (read by the old path) bit for bit.
    from hytrain.job import reads

    read = []
    real = reads.read_into
    monkeypatch.setattr(reads, "read_into", lambda file, dests, **kw: read.append(file.name) or real(file, dests, **kw))
    args = ["--model", str(hf_models[kind]), "--tokenizer", "bytes", "--data", corpus, *FAST]
    a, b, c = (str(tmp_path / n) for n in "abc")
    assert main(["--steps", "6", "--out", a, "--stream", "off", *args]) == 0
    assert not read
    assert main(["--steps", "6", "--out", b, "--stream", "2", *args]) == 0
    assert read and all(f.startswith("model") for f in read)
    if kind == "fp32-shards":
        assert len(set(read)) > 3  # every shard read
    read.clear()
    assert main(["--steps", "3", "--out", c, "--stream", "3", "--save-every", "3", *args]) == 0
    read.clear()
    assert main(["--steps", "6", "--out", c, "--stream", "3", "--resume", "latest", *args]) == 0
    assert read == ["model.safetensors"]  # the checkpoint's weights only, not the model directory's
    assert losses(a) == losses(b) == losses(c) and len(losses(a)) == 6
    assert json.load(open(os.path.join(b, "summary.json")))["streamed_layers"] == 2


@pytest.mark.parametrize("kind", ["fp32-shards", "bf16-tied"])
def test_a_resident_resume_reads_the_checkpoints_weights_only(tmp_path, hf_models, corpus, monkeypatch, kind):
    # Resumed in one process, resident: the model is built empty and its weights read from the
    # checkpoint alone, not first from the model's directory and then again from the checkpoint. The
    # resumed run continues the uninterrupted one bit for bit.
    from hytrain.job import hf

    read = []
    real = hf.read_into
    monkeypatch.setattr(hf, "read_into", lambda file, dests, **kw: read.append(file) or real(file, dests, **kw))
    args = ["--model", str(hf_models[kind]), "--tokenizer", "bytes", "--data", corpus, "--stream", "off", *FAST]
    a, c = str(tmp_path / "a"), str(tmp_path / "c")
    assert main(["--steps", "6", "--out", a, *args]) == 0
    assert main(["--steps", "3", "--out", c, "--save-every", "3", *args]) == 0
    assert read and all(f.parent == hf_models[kind] for f in read)
    read.clear()
    assert main(["--steps", "6", "--out", c, "--resume", "latest", *args]) == 0
    assert read == [tmp_path / "c" / "checkpoints" / "step_00000003" / "model.safetensors"]
    assert losses(a) == losses(c) and len(losses(a)) == 6


@pytest.mark.parametrize("extra, words", [
    (["--stream", "2", "--precision", "fp32"], "only bf16/fp16 weights stream"),
    (["--stream", "9", "--precision", "bf16"], "a number of layers in [0, 4]"),
    (["--stream", "-1", "--precision", "bf16"], "--stream must be 'auto', 'off' or a number of layers (0: off)"),
    (["--stream", "2"], "only bf16/fp16 weights stream (--precision fp32, the default here; pass --precision bf16)"),
])
def test_bad_stream_options_are_one_line_with_exit_2(tmp_path, capsys, extra, words):
    args = ["--steps", "2", "--out", str(tmp_path / "run"), "--batch-size", "4", "--seq-len", "64",
            "--no-progress", "--device", "cpu", "--eval-every", "0", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_stream_value_that_is_no_number_is_named_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--stream", "abc", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["hytrain train: error: argument --stream: expected 'auto', 'off' or a "
                                         "number, got 'abc' (see hytrain train --help)"], err


def _args(**kw):
    base = dict(stream="auto", model="tiny", seq_len=64, precision=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_plan_streams_only_where_the_weights_leave_less_than_half_the_gpu(monkeypatch):
    # The 'small' preset's bf16 weights (read from a meta model: nothing is allocated), against fake
    # devices: resident where the weights leave half of the GPU free, streamed where they do not.
    with torch.device("meta"):
        model = LlamaModel(LlamaConfig(**PRESETS["small"], max_seq_len=256)).to(torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cuda = torch.device("cuda", 0)
    for total, streams in ((4 * weights, False), (weights * 19 // 10, True), (weights, True)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, t=total: (t, t))
        assert streams_when_auto(model, cuda) is streams, total / weights
        assert (stream_plan(_args(model="small"), cuda, torch.bfloat16, False) == "auto") is streams
    # Never off CUDA, under FSDP2, or for fp32 weights (they cannot stream)
    assert stream_plan(_args(model="small"), cuda, torch.float32, False) is None
    assert stream_plan(_args(model="small"), cuda, torch.bfloat16, True) is None
    assert not streams_when_auto(model, torch.device("cpu"))
    assert stream_plan(_args(stream="off"), cuda, torch.bfloat16, False) is None
    with pytest.raises(ConfigError, match="streamed weights are for one process"):
        stream_plan(_args(stream=2), cuda, torch.bfloat16, True)


@pytest.mark.gpu
def test_a_streamed_run_on_the_gpu_resumes_from_its_checkpoint(tmp_path):
    # Every layer streamed on the GPU (copy stream, read-ahead, the CPU AdamW writing the homes),
    # checkpointed at step 4 and resumed: the resumed run continues the uninterrupted one (losses to a
    # tolerance: attention's backward need not be deterministic on a GPU), and its layers streamed.
    gpu = ["--batch-size", "4", "--seq-len", "64", "--no-progress", "--device", "cuda", "--workers", "2",
           "--eval-every", "0", "--stream", "4", "--activation-checkpointing"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["--steps", "8", "--out", a, *gpu]) == 0
    assert main(["--steps", "4", "--out", b, *gpu]) == 0
    assert main(["--steps", "8", "--out", b, "--resume", "latest", *gpu]) == 0
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) == 8 and max(abs(x - y) for x, y in zip(la, lb)) < 2e-2, (la, lb)
    summary = json.load(open(os.path.join(b, "summary.json")))
    assert summary["streamed_layers"] == 4 and ckpt.resolve(b, "latest").name == "step_00000008"


def test_the_job_streams_where_the_host_cannot_hold_its_optimizers_state(monkeypatch):
    # A model whose weights leave the GPU more than half free streams anyway where the host cannot
    # hold the state in the run's format: the optimizer then keeps the first blocks' states on the GPU
    # and the streamed layers make the room (decided from the shapes, before anything is allocated).
    import torch

    import hytrain.window_plan as wp
    from hytrain.job import models
    from hytrain.job.plan import ModelPlan

    plan = ModelPlan(model="tiny", init="random", tokenizer=None, precision="bf16", stream="auto",
                     activation_checkpointing=False, seq_len=64, seed=0)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(wp.torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(wp, "host_margin", lambda available: 0)
    monkeypatch.setattr(wp, "available_memory_bytes", lambda: 64 << 30)
    assert models.stream_plan(plan, cuda, torch.bfloat16, False, "fp32") is None
    monkeypatch.setattr(wp, "available_memory_bytes", lambda: 1 << 20)  # less than the tiny model's state
    assert models.stream_plan(plan, cuda, torch.bfloat16, False, "8bit") == "auto"
    assert models.stream_plan(plan, cuda, torch.bfloat16, False, None) is None
    assert models.stream_plan(plan, cuda, torch.bfloat16, True, "8bit") is None  # (--nproc: FSDP2 shards)
