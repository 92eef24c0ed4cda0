#!/usr/bin/env python3
"""Writes reference trajectories of torch.optim.Adam and torch.optim.AdamW for the tests of
crates/distcomm-optim (run once; the tests read the committed JSON and do not need torch):

    /path/to/venv/bin/python scripts/torch_adam_reference.py > crates/distcomm-optim/tests/data/torch_adam.json

Parameters and gradients are f32 and deterministic; every step's parameters are recorded.
"""
import json
import math
import sys

import torch

N, STEPS = 37, 12


def case(mode, weight_decay, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
    init = [math.sin(0.37 * i) * 0.8 + 0.05 * i for i in range(N)]
    p = torch.tensor(init, dtype=torch.float32, requires_grad=True)
    cls = torch.optim.Adam if mode == "adam" else torch.optim.AdamW
    opt = cls([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    grads, params = [], []
    for t in range(STEPS):
        g = torch.tensor([math.cos(0.11 * i * (t + 1)) * (1.0 + 0.3 * t) - 0.2 for i in range(N)],
                         dtype=torch.float32)
        p.grad = g.clone()
        opt.step()
        grads.append([float(x) for x in g])
        params.append([float(x) for x in p.detach()])
    return {"mode": mode, "lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps,
            "weight_decay": weight_decay, "init": [float(x) for x in torch.tensor(init)],
            "grads": grads, "params": params}


cases = [case(m, wd) for m in ("adam", "adamw") for wd in (0.0, 0.1)]
json.dump({"torch": torch.__version__, "cases": cases}, sys.stdout)
