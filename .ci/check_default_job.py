"""What the README promises of `hytrain train` with no arguments on a fresh install: the embedded
default trains (the validation loss falls from about 5.5 to about 2) and writes its outputs. Exits
non-zero, naming what is missing, otherwise."""
import json
import pathlib
import sys

run = pathlib.Path(sys.argv[1])
problems = []
for name in ("summary.json", "metrics.jsonl", "config.json", "trace.json", "loss.png", "timeline.png"):
    if not (run / name).is_file():
        problems.append(f"{name} was not written")
if not any((run / "checkpoints").glob("*")):
    problems.append("no checkpoint was written")
summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
first, val = summary.get("first_loss"), summary.get("final_val_loss")
if first is None or val is None or not (first > 5.0 and val < 3.0):
    problems.append(f"the loss did not fall as the README says (first {first}, final validation {val})")
if problems:
    sys.exit("CI: the default job on a fresh install: " + "; ".join(problems))
print(f"CI: the default job trained: loss {first:.3f} -> validation {val:.3f}, {summary.get('steps')} steps, "
      f"{summary.get('tokens_per_s', 0):.0f} tokens/s")
