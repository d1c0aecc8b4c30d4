"""What the fence (python/hytrain/hybrid/fence.py) costs per torch operation while it is on the stack.

A small Llama (hytrain's own model) runs its forward three ways on the CPU: plainly; under the fence
of an optimizer whose updates count as in flight for the whole forward (the worst case: normally the
fence leaves at the first forward hook that finds nothing in flight); and under a TorchFunctionMode
that does nothing (the price of any mode). Prints the operations per forward and the microseconds
each adds, as one JSON line. The end-to-end cost is in bench/train_bench.py (hytrain_auto against
hytrain_nofence).
"""

import argparse
import json
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

import hytrain
from hytrain.models import LlamaConfig, LlamaModel


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class _Nothing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=args.layers, num_heads=4,
                      num_kv_heads=2, max_seq_len=64)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    opt = hytrain.HybridAdamW(model.parameters(), model=model, workers=1)
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    model(x, x).backward()
    opt.step()
    opt.synchronize()

    def forward_s():
        with torch.no_grad():
            for _ in range(20):
                model(x)
            t = time.perf_counter()
            for _ in range(args.iters):
                model(x)
        return (time.perf_counter() - t) / args.iters

    count = _Count()
    with count, torch.no_grad():
        model(x)
    plain = forward_s()
    engine = opt._engine
    fence = engine.fence
    engine.in_flight = lambda: True  # the fence stays for the whole forward
    torch._C._push_on_torch_function_stack(fence)
    fence._on_stack, fence._thread = True, threading.get_ident()
    fenced = forward_s()
    del engine.in_flight
    fence.disarm(force=True)
    with _Nothing():
        nothing = forward_s()
    print(json.dumps({"ops_per_forward": count.n, "forward_ms": round(plain * 1e3, 3),
                      "fence_us_per_op": round((fenced - plain) / count.n * 1e6, 2),
                      "empty_mode_us_per_op": round((nothing - plain) / count.n * 1e6, 2)}))


if __name__ == "__main__":
    main()
