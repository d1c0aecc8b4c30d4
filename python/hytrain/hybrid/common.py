"""What the parts of HybridAdamW share."""

import torch

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
