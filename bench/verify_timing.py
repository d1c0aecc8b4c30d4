"""Checkpoint verification rate: shard files hashed in parallel by hytrain.checkpoint, as a resume
verifies them before loading anything. Prints the rate and what it means for L7B's sharded state
(bf16 weights plus fp32 master, m and v: 6.74 G parameters x 14 bytes = 94 GB). The files are fresh
in the page cache, so this is the hashing rate; a cold read is bounded by the disk as well.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from hytrain import checkpoint as ckpt

L7B_STATE_GB = 6.74e9 * 14 / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mib", type=int, default=512, help="MiB per file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "step_00000001"
        root.mkdir()
        block = os.urandom(1 << 24)
        for i in range(args.files):
            with open(root / f"__{i}_0.distcp", "wb") as f:
                for _ in range(args.mib // 16):
                    f.write(block)
        names = [f.name for f in root.iterdir()]
        t = time.perf_counter()
        files = ckpt.digests(root, names)
        digest_s = time.perf_counter() - t
        ckpt.write_meta(root, {"format": ckpt.SHARDED_FORMAT, "step": 1, "world_size": 1, "extra": {},
                               "files": files})
        t = time.perf_counter()
        ckpt.verify(root)
        verify_s = time.perf_counter() - t
    gb = args.files * args.mib * 2**20 / 1e9
    print(json.dumps({"gb": round(gb, 2), "threads": ckpt._hash_workers(), "digest_s": round(digest_s, 2),
                      "verify_s": round(verify_s, 2), "verify_gb_per_s": round(gb / verify_s, 2),
                      "l7b_state_gb": round(L7B_STATE_GB, 1),
                      "l7b_verify_s_at_this_rate": round(L7B_STATE_GB / (gb / verify_s), 1)}))


if __name__ == "__main__":
    main()
