"""transformers' Trainer on one GPU with each optimizer path, side by side in one run: what a user gets
by handing HybridAdamW to the loop they already run, and what the integration adds.

Workload: a Llama shape (``--hidden``, ``--layers``; vocab 32000), random tokens, micro-batch
``--batch`` x ``--seq``, bf16, lr 1e-4 (no weight decay: the same on every parameter in every mode), the
Trainer's ``max_grad_norm=1.0``. The model
is built on the CPU and the optimizer before the Trainer moves it to the GPU.

Modes (each in its own process):
  torch              the Trainer's own AdamW (fused, on the GPU), fp32 weights, bf16 autocast (reference)
  hybrid_plain       Trainer(optimizers=(HybridAdamW(model.parameters()), None)): the Trainer's
                     clip_grad_norm_ rescales the kept gradients, so the blocks handed off during
                     backward are redone in step() (exact; the slow path)
  hybrid_routed      hytrain.integrations.HybridTrainer: clipping routed into HybridAdamW (the fast path)
  hybrid_routed_bf16 as hybrid_routed, with the model cast to bf16 after the optimizer was built
                     (fp32 masters on the host)

Each mode prints a JSON line: step_s (median of the timed steps), peak_gpu_gb (allocated), the losses
and grad norms the Trainer logged. The last line gives each hytrain mode's step time against torch's
and its largest relative loss difference from torch's run (the same data, seeds and schedule).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("torch", "hybrid_plain", "hybrid_routed", "hybrid_routed_bf16")


def run_mode(mode, args):
    import torch
    import transformers

    import hytrain
    from hytrain.integrations import HybridTrainer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                                   num_key_value_heads=args.hidden // 128, max_position_embeddings=args.seq)
    model = transformers.LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(0, 32000, (args.batch * args.steps, args.seq), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    out = tempfile.mkdtemp()
    targs = transformers.TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=1e-4,
        weight_decay=0.0, max_grad_norm=1.0, bf16=True, logging_steps=1, save_strategy="no", report_to="none",
        seed=0, dataloader_num_workers=0, disable_tqdm=True, lr_scheduler_type="constant",
        use_cpu=not torch.cuda.is_available())
    clock = Clock()
    kw = dict(model=model, args=targs, train_dataset=Tokens(), callbacks=[clock])
    if mode == "torch":
        trainer = transformers.Trainer(**kw)
    elif mode == "hybrid_plain":
        opt = hytrain.HybridAdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        trainer = transformers.Trainer(optimizers=(opt, None), **kw)
    else:
        if mode == "hybrid_routed_bf16":
            model.to(torch.bfloat16)
        trainer = HybridTrainer(**kw)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])][args.warmup:]
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return dict(mode=mode, params_m=round(n_params / 1e6, 1), step_s=statistics.median(steps),
                peak_gpu_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                k=getattr(opt, "gpu_blocks", None),
                losses=[h["loss"] for h in logs], grad_norms=[h["grad_norm"] for h in logs])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5, help="steps not timed")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, args)), flush=True)
        return
    results = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                              ("hidden", "layers", "batch", "seq", "steps", "warmup")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(json.dumps({"mode": mode, "error": proc.stderr.strip().splitlines()[-3:]}), flush=True)
            continue
        results[mode] = json.loads(lines[-1][len("RESULT "):])
        print(json.dumps(results[mode]), flush=True)
    ref = results.get("torch")
    if ref is None:
        return
    summary = {}
    for mode, r in results.items():
        if mode == "torch":
            continue
        dloss = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        summary[mode] = dict(step_vs_torch=round(r["step_s"] / ref["step_s"], 3), max_rel_loss_diff=dloss,
                             gpu_mem_vs_torch=round(r["peak_gpu_gb"] / max(ref["peak_gpu_gb"], 1e-9), 3))
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
