"""FSDP2 + HybridAdamW on several processes: the model is sharded with fully_shard (each layer a
unit, then the root), and each rank keeps the fp32 masters and Adam states of its own shards in host
memory. Clipping (max_grad_norm) uses the global norm over all ranks. With --out, a sharded
checkpoint is saved at the end, beside the full weights as one safetensors file, and --resume latest
goes on from it (at this or another number of processes).

    torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py [--steps 40] [--out runs/fsdp2 [--resume latest]]

One process per GPU (NCCL) when there are GPUs, else CPU processes (gloo). The data has something
to learn (a Markov chain: each token is followed by one of four); the script checks that the model
predicts the next token of unseen rows better than the token frequencies alone do.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hytrain
from hytrain import dist_checkpoint
from hytrain.distributed import init_process_group
from hytrain.models import LlamaConfig, LlamaModel

from _data import held_out_loss, markov_rows  # examples/_data.py

GLOBAL_BATCH = 8  # sequences per step, split between the ranks

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out", default=None, help="save a sharded checkpoint and the full weights here at the end")
ap.add_argument("--resume", default=None, help="'latest' (in --out) or a checkpoint directory to start from")
args = ap.parse_args()
if args.resume == "latest" and not args.out:
    ap.error("--resume latest needs --out")

use_cuda = torch.cuda.is_available() and hytrain.cuda_available()
rank, world = init_process_group("nccl" if use_cuda else "gloo")
if use_cuda:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
dtype = torch.bfloat16 if use_cuda else torch.float32

torch.manual_seed(0)  # the same initial weights on every rank
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=2, max_seq_len=64)
model = LlamaModel(config).to(device, dtype)
mesh = init_device_mesh(device.type, (world,))
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, model=model)

start = 0
if args.resume:  # a checkpoint saved by any number of processes
    start = dist_checkpoint.load(dist_checkpoint.resolve(args.out, args.resume), model, opt)["step"]
    if rank == 0:
        print(f"resumed from step {start}")

# The same global batch on every rank (a function of the step); each rank trains on its slice of it.
rows = GLOBAL_BATCH // world
losses = []
for step in range(start, args.steps):
    x = markov_rows(GLOBAL_BATCH, seed=step)[rank * rows:(rank + 1) * rows].to(device)
    loss = model(x, x)  # next-token prediction: the model shifts the labels itself
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the mean over the ranks, for the log
    losses.append(total.item() / world)
    if rank == 0 and (step + 1) % 5 == 0:
        print(f"step {step + 1:3d}  loss {losses[-1]:.4f}  grad norm {opt.last_grad_norm:.3f}")

if args.out:
    dist_checkpoint.save(args.out, args.steps, model, opt)  # sharded, atomic, loads at any world size
    dist_checkpoint.export_safetensors(os.path.join(args.out, "model.safetensors"), model)
if rank == 0 and losses:
    print(f"{world} ranks: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
seen = torch.cat([markov_rows(GLOBAL_BATCH, seed=s) for s in range(args.steps)])
held, unigram = held_out_loss(model, seen, device)
if rank == 0:
    print(f"held-out next-token loss {held:.3f}, unigram baseline {unigram:.3f}")
assert held < unigram - 0.3, "the model has not learned which tokens come next"
dist.destroy_process_group()
